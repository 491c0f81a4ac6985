"""The run store's index: SQLite (WAL mode, busy timeout; a new file's switch to WAL is retried,
``_enable_wal``) holding each run's status, config, summary and error, the leases that keep two
processes from training one run, the checksums of the files a finished run wrote, group-engine
failures, and the time ledger (the wall time and FLOP of every job, report and sweep, append-only).
Nothing here reads or writes a run's files.

An index opened read-only (``RunIndex(..., read_only=True)``, and ``integrity.verify_store`` always)
never writes: see ``connect_read_only``."""

from __future__ import annotations

import json
import os
import random
import socket
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

from ..config import RunConfig
from ..model.config import size_label
from .errors import RunNotFoundError, StoreDamagedError, StoreError, StoreReadOnlyError

__all__ = ["RunIndex", "STALE_SECONDS", "LEDGER_KINDS", "connect_read_only"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    status TEXT NOT NULL,            -- running | done | failed
    task TEXT, path TEXT, seed INTEGER, model TEXT,
    config TEXT NOT NULL,
    summary TEXT,
    error TEXT,
    owner TEXT,
    heartbeat REAL,
    created REAL, updated REAL
);
CREATE TABLE IF NOT EXISTS files (
    run_id TEXT NOT NULL,
    name TEXT NOT NULL,              -- relative to the run directory, e.g. final.safetensors
    sha256 TEXT NOT NULL,            -- of the bytes written, computed at write time
    size INTEGER NOT NULL,
    PRIMARY KEY (run_id, name)
);
CREATE TABLE IF NOT EXISTS engine_errors (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_ids TEXT NOT NULL,           -- JSON list: the group whose training raised
    error TEXT NOT NULL,             -- 'Type: message' and the traceback
    owner TEXT,
    created REAL
);
CREATE TABLE IF NOT EXISTS record_sightings (  -- the store's clock for calibration records: append-only
    hash TEXT PRIMARY KEY,           -- a calibration record's hash
    first_seen REAL NOT NULL,        -- when this store first read a valid record with that hash
    source TEXT                      -- the file it was read from
);
CREATE TRIGGER IF NOT EXISTS record_sightings_no_update BEFORE UPDATE ON record_sightings
BEGIN SELECT RAISE(ABORT, 'record_sightings is append-only'); END;
CREATE TRIGGER IF NOT EXISTS record_sightings_no_delete BEFORE DELETE ON record_sightings
BEGIN SELECT RAISE(ABORT, 'record_sightings is append-only'); END;
CREATE TABLE IF NOT EXISTS ledger (  -- the time ledger (RunIndex.record_timing): append-only
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,              -- job (one run or a group trained together) | report | sweep
    name TEXT NOT NULL,              -- a job's runs (task, model, path and seed of each), a report's experiment
    seconds REAL NOT NULL,           -- wall time: a job resumed from checkpoints, the sum of its pieces
    flop REAL NOT NULL,              -- FLOP trained (flops.train_step_flops x steps, over the runs); 0 for a report
    runs INTEGER NOT NULL,           -- runs trained (a job) or read (a report)
    started_at REAL NOT NULL,        -- unix time its first piece started
    host TEXT,
    code_version TEXT,               -- provenance.code_version of the code that ran it
    gemm_gflops REAL,                -- the GEMM rate the sweep measured on its machine (flops.gemm_rate); NULL if none
    detail TEXT,                     -- JSON: run_ids, pieces [[started_at, seconds], ...], steps, status, threads, ...
    created REAL
);
CREATE TRIGGER IF NOT EXISTS ledger_no_update BEFORE UPDATE ON ledger
BEGIN SELECT RAISE(ABORT, 'the ledger is append-only'); END;
CREATE TRIGGER IF NOT EXISTS ledger_no_delete BEFORE DELETE ON ledger
BEGIN SELECT RAISE(ABORT, 'the ledger is append-only'); END;
"""


def _add_record_column(db) -> None:
    """``runs.record``: the hash of the calibration record a finished run ran under ('' for none; NULL
    for runs committed before the store kept its clock, store/record_clock.py)."""
    if "record" not in {r[1] for r in db.execute("PRAGMA table_info(runs)")}:
        try:
            db.execute("ALTER TABLE runs ADD COLUMN record TEXT")
        except sqlite3.OperationalError as e:  # another process added it first
            if "duplicate column" not in str(e):
                raise


LEDGER_KINDS = ("job", "report", "sweep")  # the time ledger's rows (``RunIndex.record_timing``)
BUSY_SECONDS = 60.0  # how long a connection waits for another process's lock (and a new index's switch to WAL)
STALE_SECONDS = 6 * 3600.0  # a 'running' claim from another host without a heartbeat for this long is void


def _enable_wal(db: sqlite3.Connection, timeout: float = BUSY_SECONDS) -> None:
    """Put the index in WAL mode (kept in the file). Switching a new file to WAL takes an exclusive
    lock, and where several processes open a new store at once SQLite answers the others' switch with
    "database is locked" at once, without waiting on the busy timeout (the lock upgrade would deadlock):
    so wait and try again, up to ``timeout`` seconds. A file already in WAL mode needs no lock."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.005 + 0.045 * random.random())


def _owner_alive(owner: str | None) -> bool:
    """False when ``owner`` ('host:pid') is a process of this host that no longer exists."""
    if not owner:
        return False
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname():
        return True  # unknown: rely on the heartbeat
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def _same_host(owner: str | None) -> bool:
    """Whether ``owner`` ('host:pid') is a process of this host (whose liveness ``_owner_alive`` sees;
    a live one keeps its claims however long its sweep runs, e.g. runs queued behind hours of others)."""
    return bool(owner) and owner.rpartition(":")[0] == socket.gethostname()


def connect_read_only(path: Path) -> sqlite3.Connection:
    """A connection to the index at ``path`` that cannot write it, nor leave a file behind.

    Where the directory can be written, a plain connection with ``query_only`` (SQLite's ``mode=ro``
    would leave the -wal and -shm files behind when it closes). Where it cannot (a store shared
    read-only, a read-only mount), ``mode=ro``; a WAL database without its -shm file cannot be opened
    so on read-only media, so then ``immutable=1`` (the file cannot change there), unless a non-empty
    -wal file holds commits that only a writable open would read (then a one-line StoreReadOnlyError)."""
    path = Path(path)
    if os.access(path.parent, os.W_OK):
        db = sqlite3.connect(path, timeout=BUSY_SECONDS, isolation_level=None)
        db.execute("PRAGMA query_only=ON")
        return db
    uri = f"file:{quote(str(path.resolve()))}"
    try:
        db = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=BUSY_SECONDS, isolation_level=None)
        db.execute("PRAGMA schema_version")  # SQLite opens the file here: on read-only media this may fail
        return db
    except sqlite3.OperationalError:
        pass
    wal = path.with_name(path.name + "-wal")
    if wal.exists() and wal.stat().st_size > 0:
        raise StoreReadOnlyError(
            f"store {str(path.parent)!r} is read-only and its index has commits in {wal.name} that SQLite reads "
            "only with write access: open it once where it can be written (e.g. `softprior store verify` there)")
    return sqlite3.connect(f"{uri}?immutable=1", uri=True, timeout=BUSY_SECONDS, isolation_level=None)


class RunIndex:
    """``read_only``: the index is opened with ``connect_read_only`` and every write raises
    ``StoreReadOnlyError``; nothing is created (the index must exist)."""

    def __init__(self, root: Path, owner: str, read_only: bool = False):
        self.root, self.owner, self.read_only = Path(root), owner, read_only
        if not read_only:
            with self._connect(write=True) as db:
                db.executescript(_SCHEMA)
                _add_record_column(db)

    @contextmanager
    def _connect(self, write: bool = False):
        if self.read_only and write:
            raise StoreReadOnlyError.at(self.root)
        try:
            if self.read_only:
                db = connect_read_only(self.root / "index.sqlite")
            else:
                db = sqlite3.connect(self.root / "index.sqlite", timeout=BUSY_SECONDS, isolation_level=None)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open the index of store {str(self.root)!r}: {e}") from None
        try:
            db.execute(f"PRAGMA busy_timeout={int(BUSY_SECONDS * 1000)}")
            if not self.read_only:
                _enable_wal(db)
            db.row_factory = sqlite3.Row
            yield db
        except sqlite3.OperationalError as e:  # locked, unwritable, ...: not damage
            raise StoreError(f"store {str(self.root)!r}: the index cannot be used: {e}") from None
        except sqlite3.DatabaseError as e:
            raise StoreDamagedError(f"store {str(self.root)!r} index is unreadable: {e}; `softprior store verify "
                                    f"--store {str(self.root)!r} --repair` rebuilds it from the run directories") from None
        finally:
            db.close()

    def status(self, run_id: str) -> str | None:
        with self._connect() as db:
            row = db.execute("SELECT status FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return row["status"] if row else None

    def is_done(self, run_id: str) -> bool:
        return self.status(run_id) == "done"

    def claim(self, cfg: RunConfig) -> bool:
        """Atomically mark ``cfg`` as running by this process. False if done or held by a live owner."""
        now = time.time()
        with self._connect(write=True) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT status, owner, heartbeat FROM runs WHERE run_id=?",
                                 (cfg.run_id,)).fetchone()
                if row is not None:
                    if row["status"] == "done":
                        db.execute("ROLLBACK")
                        return False
                    # a live owner keeps its claim; only a claim from another host (whose liveness this
                    # host cannot see) expires with its heartbeat
                    if (row["status"] == "running" and row["owner"] != self.owner and _owner_alive(row["owner"])
                            and (_same_host(row["owner"]) or now - (row["heartbeat"] or 0) < STALE_SECONDS)):
                        db.execute("ROLLBACK")
                        return False
                db.execute(
                    "INSERT INTO runs(run_id, status, task, path, seed, model, config, owner, heartbeat, created, updated)"
                    " VALUES(?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT(run_id) DO UPDATE SET status='running', owner=excluded.owner,"
                    " heartbeat=excluded.heartbeat, error=NULL, updated=excluded.updated",
                    (cfg.run_id, cfg.task.name, cfg.path.name, cfg.seed, size_label(cfg.model),
                     json.dumps(cfg.canonical(), sort_keys=True), self.owner, now, now, now))
                db.execute("COMMIT")
                return True
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def heartbeat(self, run_id: str | None = None) -> None:
        """Refresh this process's claim on ``run_id``, or (None) on every run it holds."""
        with self._connect(write=True) as db:
            if run_id is None:
                db.execute("UPDATE runs SET heartbeat=? WHERE owner=? AND status='running'", (time.time(), self.owner))
            else:
                db.execute("UPDATE runs SET heartbeat=? WHERE run_id=? AND owner=?", (time.time(), run_id, self.owner))

    def release(self, run_id: str) -> None:
        """Drop this process's claim on an unfinished run (e.g. on Ctrl-C)."""
        with self._connect(write=True) as db:
            db.execute("UPDATE runs SET heartbeat=0 WHERE run_id=? AND owner=? AND status='running'",
                       (run_id, self.owner))

    def file_checksums(self, run_id: str) -> dict[str, tuple[str, int]]:
        """{file name relative to the run directory: (SHA-256, size)} recorded when the run was saved."""
        with self._connect() as db:
            rows = db.execute("SELECT name, sha256, size FROM files WHERE run_id=?", (run_id,)).fetchall()
        return {r["name"]: (r["sha256"], r["size"]) for r in rows}

    def record_failure(self, cfg: RunConfig, error: str) -> None:
        now = time.time()
        with self._connect(write=True) as db:
            db.execute(
                "INSERT INTO runs(run_id, status, task, path, seed, model, config, error, owner, created, updated)"
                " VALUES(?, 'failed', ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(run_id) DO UPDATE SET status='failed', error=excluded.error, updated=excluded.updated"
                " WHERE runs.status != 'done'",  # never over a result another process committed
                (cfg.run_id, cfg.task.name, cfg.path.name, cfg.seed, size_label(cfg.model),
                 json.dumps(cfg.canonical(), sort_keys=True), error, self.owner, now, now))

    def record_engine_error(self, run_ids: list[str], error: str) -> None:
        """Keep the exception (with traceback) of a group engine that failed on ``run_ids`` (the sweep
        then retrains them alone, so the runs' own rows would not show it)."""
        with self._connect(write=True) as db:
            db.execute("INSERT INTO engine_errors(run_ids, error, owner, created) VALUES(?, ?, ?, ?)",
                       (json.dumps(list(run_ids)), error, self.owner, time.time()))

    def engine_errors(self) -> list[dict]:
        """Recorded group engine failures, oldest first: {run_ids, error, owner, created}."""
        with self._connect() as db:
            rows = db.execute("SELECT run_ids, error, owner, created FROM engine_errors ORDER BY id").fetchall()
        return [{**dict(r), "run_ids": json.loads(r["run_ids"])} for r in rows]

    def rows(self) -> list[dict]:
        with self._connect() as db:
            return [dict(r) for r in db.execute("SELECT * FROM runs ORDER BY created")]

    def commit_done(self, cfg: RunConfig, summary: dict, sums: dict[str, tuple[str, int]]) -> None:
        """Mark a run done with its summary and the checksums of its files, in one transaction; its
        ``record`` is the summary's calibration record ('' for none)."""
        now = time.time()
        with self._connect(write=True) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "INSERT INTO runs(run_id, status, task, path, seed, model, config, summary, owner, created, updated,"
                    " record) VALUES(?, 'done', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT(run_id) DO UPDATE SET status='done', summary=excluded.summary, error=NULL,"
                    " updated=excluded.updated, record=excluded.record",
                    (cfg.run_id, cfg.task.name, cfg.path.name, cfg.seed, size_label(cfg.model),
                     json.dumps(cfg.canonical(), sort_keys=True), json.dumps(summary), self.owner, now, now,
                     summary.get("calibration") or ""))
                db.execute("DELETE FROM files WHERE run_id=?", (cfg.run_id,))
                db.executemany("INSERT INTO files(run_id, name, sha256, size) VALUES(?, ?, ?, ?)",
                               [(cfg.run_id, name, h, n) for name, (h, n) in sums.items()])
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def forget(self, run_ids: list[str]) -> None:
        """Delete the rows and checksums of ``run_ids`` in one transaction (``store verify --repair``
        re-queues damaged runs so: the next sweep trains them again)."""
        with self._connect(write=True) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                for rid in run_ids:
                    db.execute("DELETE FROM runs WHERE run_id=?", (rid,))
                    db.execute("DELETE FROM files WHERE run_id=?", (rid,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def row(self, run_id: str):
        if not run_id:
            raise RunNotFoundError(f"empty run id {run_id!r}; give a run id or a prefix of one")
        with self._connect() as db:
            rows = db.execute("SELECT * FROM runs WHERE substr(run_id, 1, ?) = ?", (len(run_id), run_id)).fetchall()
        if not rows:
            raise RunNotFoundError(f"run {run_id!r} not found in store {str(self.root)!r} (give a run id, or a prefix "
                                   "of one, as `softprior train` prints it; or check --store)")
        if len(rows) > 1:
            raise RunNotFoundError(f"run id prefix {run_id!r} is ambiguous: {', '.join(r['run_id'] for r in rows)}")
        return rows[0]

    # ------------------------------------------------------------------ the clock of calibration records
    def record_sightings(self) -> dict[str, float]:
        """Calibration record hash -> when this store first saw it (``store/record_clock.py``)."""
        with self._connect() as db:
            return {r["hash"]: r["first_seen"] for r in db.execute("SELECT hash, first_seen FROM record_sightings")}

    def see_records(self, sources: dict[str, str], when: float | None = None) -> dict[str, float]:
        """Note now (or ``when``: a repair carries sightings over) as the first sighting of each record
        hash of ``sources`` (hash -> file) not seen before (append-only: an earlier sighting stays);
        returns every sighting."""
        now = time.time() if when is None else when
        with self._connect(write=True) as db:
            db.executemany("INSERT OR IGNORE INTO record_sightings(hash, first_seen, source) VALUES(?, ?, ?)",
                           [(h, now, src) for h, src in sources.items()])
        return self.record_sightings()

    # ------------------------------------------------------------------ the time ledger
    def record_timing(self, kind: str, name: str, seconds: float, flop: float = 0.0, runs: int = 0,
                      started_at: float | None = None, host: str | None = None, code_version: str | None = None,
                      gemm_gflops: float | None = None, detail: dict | None = None,
                      created: float | None = None) -> None:
        """Append one row to the time ledger (never updated nor deleted: see ``ledger``); ``created``
        is now and ``host`` this machine, unless a row carried over from a damaged index
        (``store.integrity``) keeps its own (a row that named no host names none)."""
        if kind not in LEDGER_KINDS:
            raise ValueError(f"unknown ledger kind {kind!r}; allowed: {', '.join(LEDGER_KINDS)}")
        now = time.time() if created is None else float(created)
        with self._connect(write=True) as db:
            db.execute("INSERT INTO ledger(kind, name, seconds, flop, runs, started_at, host, code_version, gemm_gflops,"
                       " detail, created) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (kind, name, float(seconds), float(flop), int(runs), now - seconds if started_at is None
                        else float(started_at), host if host or created is not None else socket.gethostname(), code_version,
                        None if gemm_gflops is None else float(gemm_gflops), json.dumps(detail or {}), now))

    def ledger(self) -> list[dict]:
        """The time ledger's rows, oldest first, ``detail`` decoded (empty for an index written before the
        store kept one: a read-only one is not given the table)."""
        with self._connect() as db:
            if db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='ledger'").fetchone() is None:
                return []
            rows = db.execute("SELECT * FROM ledger ORDER BY id").fetchall()
        return [{**dict(r), "detail": json.loads(r["detail"] or "{}")} for r in rows]

    def started(self, run_ids: list[str]) -> dict[str, float]:
        """Run id -> when its row was created (its first claim), for those of ``run_ids`` in the index."""
        out, ids = {}, list(run_ids)
        with self._connect() as db:
            for i in range(0, len(ids), 500):
                part = ids[i:i + 500]
                q = f"SELECT run_id, created FROM runs WHERE run_id IN ({','.join('?' * len(part))})"
                out.update({r["run_id"]: r["created"] for r in db.execute(q, part)})
        return out
