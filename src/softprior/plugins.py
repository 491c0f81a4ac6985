"""Plugin files: a user's Python file, passed as ``--plugin FILE``, that registers experiments, paths,
tasks (``softprior.tasks.registry.register_task``) or priors (``softprior.model.priors.register_prior``).

``load_plugin`` runs the file once per process (a second load of the same file is a no-op, so a
registration is never repeated) and notes it in the environment variable ``SOFTPRIOR_PLUGINS``. The
executors' spawned worker processes inherit the environment, so a registry that does not know a name
(a plugin task's config read back from the store, a plugin prior's model built in a worker) loads
the noted files there (``load_noted_plugins``) and looks again. A local Ray cluster started by this
process inherits it too; a remote Ray cluster does not (start its workers with the variable set).
A bottom-layer module: it imports nothing of the package.
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path

__all__ = ["load_plugin", "load_noted_plugins", "PluginError", "ENV", "current_plugin"]

ENV = "SOFTPRIOR_PLUGINS"
_LOADED: set[str] = set()
_CURRENT: list[str] = []  # the file being run, for registries that note where an entry came from


class PluginError(ValueError):
    pass


def current_plugin() -> str | None:
    """The plugin file being run now (its registrations come from it), or None."""
    return _CURRENT[-1] if _CURRENT else None


def load_plugin(path: str) -> None:
    """Execute a user's Python file that registers experiments, paths, tasks or priors. A missing file
    or any exception raised while running it (a syntax error included) becomes a one-line
    ``PluginError`` naming the file."""
    try:
        ok = Path(path).is_file()
    except (OSError, ValueError):  # e.g. a NUL byte in the name
        ok = False
    if not ok:
        raise PluginError(f"plugin file {str(path)!r} does not exist")
    full = str(Path(path).resolve())
    if full in _LOADED:
        return
    _CURRENT.append(full)
    try:
        runpy.run_path(full, run_name="softprior_plugin")
    except Exception as e:  # noqa: BLE001 - the user's code: report it, naming the file
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
        detail = " ".join(str(e.msg if isinstance(e, SyntaxError) else e).split())
        raise PluginError(f"plugin file {str(path)!r} failed: {type(e).__name__}: {detail}{where}") from None
    finally:
        _CURRENT.pop()
    _LOADED.add(full)
    noted = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p]
    if full not in noted:
        os.environ[ENV] = os.pathsep.join(noted + [full])


def load_noted_plugins() -> bool:
    """Load every file noted in ``SOFTPRIOR_PLUGINS`` not loaded yet (a worker process); True if any was.
    A noted file that no longer exists is passed over (the lookup then names the unknown entry)."""
    todo = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p and p not in _LOADED and Path(p).is_file()]
    for p in todo:
        load_plugin(p)
    return bool(todo)
