"""Where commands write: --out, --doc and --readme checked before any work is done, the files a report
wrote, and a report's row in the store's time ledger."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .common import CliError


def _creatable(path: str, flag: str) -> Path:
    """``path`` where it can be created: its nearest existing ancestor is a directory we may write
    (a one-line error naming ``flag`` if not, before any work is done)."""
    p = Path(path)
    try:
        q = p.absolute()
        while not q.exists():
            q = q.parent
    except (OSError, ValueError) as e:  # e.g. a NUL byte in the name
        raise CliError(f"{flag} {path!r} is not a usable path ({e})") from None
    if q == p.absolute() and q.is_file():  # a file to rewrite (a --doc, a --readme)
        if not os.access(q, os.W_OK):
            raise CliError(f"{flag} {path!r} cannot be written: the file is read-only")
        return p
    if not q.is_dir():
        raise CliError(f"{flag} {path!r} cannot be created: {str(q)!r} is a file, not a directory")
    if not os.access(q, os.W_OK):
        raise CliError(f"{flag} {path!r} cannot be written: directory {str(q)!r} is read-only")
    return p


def _out_dir(path: str, flag: str = "--out") -> Path:
    """A directory to write into (created if missing)."""
    p = _creatable(path, flag)
    if p.exists() and not p.is_dir():
        raise CliError(f"{flag} {path!r} is a file; give a directory (it receives the tables and figures)")
    return p


def _doc_file(path: str | None, flag: str = "--doc") -> None:
    """A markdown file to splice tables into (created if missing; its directory must exist)."""
    if path is None:
        return
    p = _creatable(path, flag)
    if p.is_dir():
        raise CliError(f"{flag} {path!r} is a directory; give a markdown file (tables go between "
                       "<!-- table:NAME --> markers in it)")
    if not p.absolute().parent.is_dir():
        raise CliError(f"{flag} {path!r}: directory {str(p.parent)!r} does not exist (mkdir -p {str(p.parent)!r})")


def _check_outputs(args, default_out: str) -> None:
    """--out, --doc and --readme checked before a report (or the training before it) starts."""
    _out_dir(args.out or default_out)
    _doc_file(getattr(args, "doc", None))
    _doc_file(getattr(args, "readme", None), "--readme")


def _record_report(store, name: str, started: float, seconds: float, runs: int) -> None:
    """A report's wall time in the store's time ledger (``report timings``), where the store can be
    written (``reproduce``; ``report`` only reads it)."""
    if store.read_only:
        return
    from ..provenance import code_version, provenance
    from ..store.errors import StoreError
    try:
        store.record_timing("report", name, seconds, 0.0, runs, started, code_version=code_version(provenance()))
    except StoreError as e:
        print(f"softprior: the time ledger could not record report {name!r}: {e}", file=sys.stderr)


def _files_written(out: Path, before: dict) -> list[str]:
    """The files under ``out`` created or rewritten since ``before`` (``_stamps``), by path under ``out``."""
    return sorted(k for k, v in _stamps(out).items() if before.get(k) != v)


def _stamps(out: Path) -> dict[str, int]:
    return {p.relative_to(out).as_posix(): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} \
        if out.is_dir() else {}
