"""A read-only run store is read like any other (issue 30, item 1): ``eval``, ``report``, ``export``
and ``store verify`` work on it and write nothing; ``verify`` tells read-only from damaged; ``--repair``
and ``train`` on it are one-line errors.

We run as root, which ignores permissions, so ``chmod`` proves nothing here. The store is made
read-only the way a read-only mount is seen from Python instead (``read_only_fs``): ``os.access`` says
it cannot be written, every write Python attempts under it (open for writing, mkdir, rename, remove,
...) fails with EROFS (an audit hook), and SQLite behaves as on read-only media (a read-write open and
a ``mode=ro`` open of a WAL database without its -shm file fail; ``immutable=1`` reads). Every file
and directory under the store is compared, bytes and mtimes, before and after. Where this machine
allows a private read-only bind mount (``unshare``), the same commands also run on a real one.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import unquote

import pytest

from softprior.cli import main

STEPS = "5"
PATHS = ("forced_zero", "unforced")


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def snapshot(root: Path) -> dict:
    """Every file (bytes, mtime) and directory (mtime) under ``root``, and ``root``'s own mtime."""
    out = {".": root.stat().st_mtime_ns}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        out[str(p.relative_to(root))] = (p.read_bytes(), st.st_mtime_ns) if p.is_file() else st.st_mtime_ns
    return out


PLUGIN = """
from softprior.config import make_run_config
from softprior.cells import Cell, Eval, NORMAL, ZERO
from softprior.experiments import Experiment, register_experiment

def build(opts):
    return [Cell(make_run_config("assoc_recall", p, 0, steps={steps}), row=p, evals=(ZERO, NORMAL, Eval("at 40", None, 40)))
            for p in {paths!r}]

register_experiment(Experiment("read_only_check", "two stored runs, one read from weights", build, curves=True),
                    overwrite=True)
"""


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A store holding two finished tiny runs, and a plugin experiment over them: (root, run ids, plugin)."""
    d = tmp_path_factory.mktemp("ro")
    root = d / "store"
    ids = []
    for p in PATHS:
        rc, out, err = run_cli("train", "--path", p, "--steps", STEPS, "--store", root, "--json", "--no-progress")
        assert rc == 0, err
        ids.append(json.loads(out.strip().splitlines()[-1])["run_id"])
    plugin = d / "plugin.py"
    plugin.write_text(PLUGIN.format(steps=int(STEPS), paths=PATHS))
    return root, ids, plugin


# ------------------------------------------------------------------------------ the simulation
_READ_ONLY: list[Path] = []  # the roots that are read-only right now


def _under(path) -> bool:
    if isinstance(path, int) or path is None:
        return False
    try:
        p = Path(os.fsdecode(path)).absolute()
    except (TypeError, ValueError):
        return False
    return any(p == r or r in p.parents for r in _READ_ONLY)


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _audit(event: str, args: tuple) -> None:
    """EROFS for every write Python attempts under a read-only root (as the kernel answers on a
    read-only mount; mkdir of an existing directory answers EEXIST there, as here)."""
    if not _READ_ONLY:
        return
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
        if writes and _under(path):
            raise OSError(errno.EROFS, "Read-only file system (simulated)", os.fsdecode(path))
    elif event == "os.mkdir" and _under(args[0]):
        if Path(os.fsdecode(args[0])).exists():
            raise FileExistsError(errno.EEXIST, "File exists", os.fsdecode(args[0]))
        raise OSError(errno.EROFS, "Read-only file system (simulated)", os.fsdecode(args[0]))
    elif event in ("os.rename", "os.remove", "os.rmdir", "os.truncate", "os.utime", "os.chmod", "os.chown",
                   "os.link", "os.symlink", "shutil.rmtree", "shutil.move") and any(_under(a) for a in args[:2]):
        raise OSError(errno.EROFS, "Read-only file system (simulated)", str(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: it acts only while _READ_ONLY names a root


@pytest.fixture
def read_only_fs(monkeypatch):
    """``read_only_fs(root)`` makes ``root`` read as a read-only mount does until the test ends."""
    real_access, real_connect = os.access, sqlite3.connect

    def access(path, mode, *a, **kw):
        if mode & os.W_OK and _under(path):
            return False
        return real_access(path, mode, *a, **kw)

    def connect(database, *a, uri=False, **kw):
        target = os.fsdecode(database)
        path, _, query = (target[len("file:"):] if uri and target.startswith("file:") else target).partition("?")
        path = unquote(path) if uri else path
        if not _under(path) or "immutable=1" in query.split("&") or (
                "mode=ro" in query.split("&") and Path(path + "-shm").exists()):
            return real_connect(database, *a, uri=uri, **kw)
        raise sqlite3.OperationalError("unable to open database file")  # a WAL database on read-only media

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(sqlite3, "connect", connect)

    def make(root: Path) -> None:
        _READ_ONLY.append(Path(root).absolute())

    yield make
    _READ_ONLY.clear()


# ------------------------------------------------------------------------------ the commands
def _read_commands(root: Path, ids: list[str], plugin: Path, out: Path) -> list[tuple[str, ...]]:
    return [("eval", ids[0], "--gates", "pos=0,content=0", "--length", "40", "--store", root, "--json"),
            ("export", ids[1], "--out", out / "tl.safetensors", "--store", root),
            ("report", "read_only_check", "--plugin", plugin, "--store", root, "--out", out / "report"),
            ("store", "verify", "--store", root)]


def _export(d: Path):
    """An export's metadata and tensors (its bytes vary: safetensors orders the header at random)."""
    from safetensors import safe_open
    with safe_open(str(d / "tl.safetensors"), framework="np") as f:
        return f.metadata(), {k: f.get_tensor(k).tobytes() for k in f.keys()}


def test_reads_work_on_a_read_only_store_and_change_nothing(stored, read_only_fs, tmp_path):
    root, ids, plugin = stored
    expected = [run_cli(*cmd) for cmd in _read_commands(root, ids, plugin, tmp_path / "writable")]
    assert [rc for rc, _, _ in expected] == [0, 0, 0, 0], expected
    before = snapshot(root)
    read_only_fs(root)
    got = [run_cli(*cmd) for cmd in _read_commands(root, ids, plugin, tmp_path / "ro")]
    assert [rc for rc, _, _ in got] == [0, 0, 0, 0], [err for _, _, err in got]
    assert snapshot(root) == before  # not a byte, not an mtime, not a file more or less
    # the same answers as from the writable store
    assert json.loads(got[0][1]) == json.loads(expected[0][1])
    assert _export(tmp_path / "ro") == _export(tmp_path / "writable")
    assert (tmp_path / "ro/report/table.md").read_text() == (tmp_path / "writable/report/table.md").read_text()
    assert "missing" not in (tmp_path / "ro/report/table.md").read_text()
    # verify: healthy and read-only, not "DAMAGED index"
    assert "DAMAGED" not in got[3][1] and "is healthy (read-only" in got[3][1] and "2 finished runs" in got[3][1]


def test_repair_and_train_on_a_read_only_store_are_one_line_errors(stored, read_only_fs):
    root, _, _ = stored
    before = snapshot(root)
    read_only_fs(root)
    for argv, words in ((("store", "verify", "--repair", "--store", root), ("read-only", "--repair", "without --repair")),
                        (("train", "--path", "unforced", "--seed", "7", "--steps", STEPS, "--store", root,
                          "--no-progress"), ("cannot be written",))):
        rc, out, err = run_cli(*argv)
        assert rc == 2 and "Traceback" not in err, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("softprior: error: ") and str(root) in lines[0], err
        for w in words:
            assert w in lines[0], (w, lines[0])
    from softprior.store import RunStore
    assert RunStore(root).read_only  # opened read-only by itself where its directory cannot be written
    assert RunStore(root).write_cache("trace.csv", b"1") is None  # a report's cache is skipped, not an error
    assert snapshot(root) == before


def test_damage_on_a_read_only_store_is_reported_with_a_fix_that_can_work(stored, read_only_fs, tmp_path):
    src, ids, _ = stored
    root = tmp_path / "copy"
    shutil.copytree(src, root)
    f = root / "runs" / ids[0] / "metrics.jsonl"
    f.write_bytes(f.read_bytes().replace(b"0", b"1", 1))
    before = snapshot(root)
    read_only_fs(root)
    rc, out, err = run_cli("store", "verify", "--store", root)
    assert rc == 1 and f"DAMAGED run {ids[0]}: runs/{ids[0]}/metrics.jsonl" in out
    assert "read-only: copy it somewhere writable" in out and "is healthy" not in out
    assert snapshot(root) == before


def test_reads_leave_a_writable_store_as_they_found_it(stored, tmp_path):
    """No write on a read path, read-only store or not (the index is opened query-only)."""
    src, ids, plugin = stored
    root = tmp_path / "copy"
    shutil.copytree(src, root)
    before = snapshot(root)
    for cmd in _read_commands(root, ids, plugin, tmp_path / "out"):
        rc, _, err = run_cli(*cmd)
        assert rc == 0, err
    after = snapshot(root)
    after.pop("."), before.pop(".")  # SQLite's -wal/-shm come and go with any reader's connection
    assert after == before


# ------------------------------------------------------------------------------ a real read-only mount
def _unshare_mount_works(d: Path) -> bool:
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return False
    script = f"mount --bind '{d}' '{d}' && mount -o remount,bind,ro '{d}' && ! touch '{d}/probe' 2>/dev/null"
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def test_on_a_real_read_only_mount(stored, tmp_path):
    """The same reads on a private read-only bind mount of the store (unshare -rm: no root needed where
    unprivileged user namespaces are allowed; skipped elsewhere)."""
    src, ids, plugin = stored
    root = tmp_path / "mounted"
    shutil.copytree(src, root)
    if not _unshare_mount_works(root):
        pytest.skip("no private read-only bind mount here (unshare -rm)")
    before = snapshot(root)
    code = textwrap.dedent(f"""
        import contextlib, io, json
        from softprior.cli import main
        cmds = {[[str(a) for a in c] for c in _read_commands(root, ids, plugin, tmp_path / "out")]!r}
        cmds.append(["store", "verify", "--repair", "--store", {str(root)!r}])
        res = []
        for c in cmds:
            err = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                res.append((main(c), err.getvalue()))
        print(json.dumps(res))
    """)
    script = f"mount --bind '{root}' '{root}' && mount -o remount,bind,ro '{root}' && exec '{sys.executable}' -c \"$0\""
    p = subprocess.run(["unshare", "-rm", "sh", "-c", script, code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert [rc for rc, _ in res] == [0, 0, 0, 0, 2], res
    assert "read-only" in res[-1][1] and len(res[-1][1].strip().splitlines()) == 1
    assert snapshot(root) == before
