"""The embedded run store: a SQLite index plus one directory per run.

    STORE/index.sqlite            runs(run_id, status, task, path, seed, model, config, summary, error, ...)
                                  engine_errors(run_ids, error, ...): group engine exceptions, with traceback
                                  files(run_id, name, sha256, size): checksums of every file a run wrote
    STORE/runs/RUN_ID/config.json
    STORE/runs/RUN_ID/metrics.jsonl
    STORE/runs/RUN_ID/final.safetensors      model weights (safetensors: never pickle)
    STORE/runs/RUN_ID/summary.json
    STORE/runs/RUN_ID/snapshots/step_N.safetensors  weights during training (mechanism traces)
    STORE/runs/RUN_ID/checkpoint.safetensors resumable state while a run is in progress

Runs are keyed by a hash of their canonical config (``RunConfig.run_id``). Every file is written to a
temporary name and renamed into place; only then is the run committed as done in SQLite, so a killed
process leaves either a complete run or none. The SHA-256 and size of every file a finished run
wrote are recorded in the ``files`` table in the same transaction (``softprior store verify`` checks
them, see ``softprior.integrity``). SQLite runs in WAL mode with a busy timeout; runs are
claimed in an IMMEDIATE transaction so that two processes never train the same run.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import RunConfig

__all__ = ["RunStore", "StoreError", "RunNotFoundError", "load_results"]

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
"""

STALE_SECONDS = 6 * 3600.0  # a 'running' claim from another host without a heartbeat for this long is void


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


class StoreError(RuntimeError):
    pass


class RunNotFoundError(StoreError):
    pass


def sha256_file(path: Path) -> tuple[str, int]:
    """(hex SHA-256, size in bytes) of a file."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            n += len(block)
    return h.hexdigest(), n


def _atomic_write_bytes(path: Path, data: bytes) -> tuple[str, int]:
    """Write ``data`` to ``path`` atomically; return its (SHA-256, size)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest(), len(data)


def _atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> tuple[str, int]:
    """Save ``tensors`` to ``path`` atomically; return the (SHA-256, size) of the file written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={k: json.dumps(v) for k, v in (metadata or {}).items()})
    digest = sha256_file(tmp)  # what is on disk, read back before it takes the final name
    os.replace(tmp, path)
    return digest


def _model_label(cfg: RunConfig) -> str:
    m = cfg.model
    return "large" if (m.n_layers, m.d_model) == (4, 128) else ("base" if (m.n_layers, m.d_model) == (2, 64)
                                                                else f"L{m.n_layers}d{m.d_model}")


class RunStore:
    def __init__(self, root: str | os.PathLike = "runs"):
        self.root = Path(root)
        try:
            (self.root / "runs").mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StoreError(f"store directory {str(self.root)!r} cannot be written: {e.strerror}") from None
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        with self._connect() as db:
            db.executescript(_SCHEMA)

    # ------------------------------------------------------------------ sqlite
    @contextmanager
    def _connect(self):
        try:
            db = sqlite3.connect(self.root / "index.sqlite", timeout=60.0, isolation_level=None)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open the index of store {str(self.root)!r}: {e}") from None
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA busy_timeout=60000")
            db.row_factory = sqlite3.Row
            yield db
        except sqlite3.DatabaseError as e:
            raise StoreError(f"store {str(self.root)!r} index is unreadable: {e}") from None
        finally:
            db.close()

    def run_dir(self, run_id: str) -> Path:
        return self.root / "runs" / run_id

    def status(self, run_id: str) -> str | None:
        with self._connect() as db:
            row = db.execute("SELECT status FROM runs WHERE run_id=?", (run_id,)).fetchone()
        return row["status"] if row else None

    def is_done(self, run_id: str) -> bool:
        return self.status(run_id) == "done"

    def claim(self, cfg: RunConfig) -> bool:
        """Atomically mark ``cfg`` as running by this process. False if done or held by a live owner."""
        now = time.time()
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT status, owner, heartbeat FROM runs WHERE run_id=?",
                                 (cfg.run_id,)).fetchone()
                if row is not None:
                    if row["status"] == "done":
                        db.execute("ROLLBACK")
                        return False
                    if (row["status"] == "running" and row["owner"] != self.owner and _owner_alive(row["owner"])
                            and now - (row["heartbeat"] or 0) < STALE_SECONDS):
                        db.execute("ROLLBACK")
                        return False
                db.execute(
                    "INSERT INTO runs(run_id, status, task, path, seed, model, config, owner, heartbeat, created, updated)"
                    " VALUES(?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT(run_id) DO UPDATE SET status='running', owner=excluded.owner,"
                    " heartbeat=excluded.heartbeat, error=NULL, updated=excluded.updated",
                    (cfg.run_id, cfg.task.name, cfg.path.name, cfg.seed, _model_label(cfg),
                     json.dumps(cfg.canonical(), sort_keys=True), self.owner, now, now, now))
                db.execute("COMMIT")
                return True
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def heartbeat(self, run_id: str) -> None:
        with self._connect() as db:
            db.execute("UPDATE runs SET heartbeat=? WHERE run_id=? AND owner=?", (time.time(), run_id, self.owner))

    def release(self, run_id: str) -> None:
        """Drop this process's claim on an unfinished run (e.g. on Ctrl-C)."""
        with self._connect() as db:
            db.execute("UPDATE runs SET heartbeat=0 WHERE run_id=? AND owner=? AND status='running'",
                       (run_id, self.owner))

    # ------------------------------------------------------------------ writing results
    def save_result(self, result) -> None:
        """Write a finished run's files atomically, then commit it as done together with the SHA-256
        of every file written (table ``files``). The summary names the calibration record that covers
        the run's configuration (``calibration.record``; None if none does)."""
        from .calibration.record import covering_records
        cfg = result.config
        result.summary.setdefault("calibration", covering_records([cfg], self.root)[cfg.run_id])
        d = self.run_dir(cfg.run_id)
        d.mkdir(parents=True, exist_ok=True)
        sums = {"config.json": _atomic_write_bytes(d / "config.json", cfg.model_dump_json(indent=2).encode()),
                "metrics.jsonl": _atomic_write_bytes(
                    d / "metrics.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in result.metrics).encode()),
                "final.safetensors": _atomic_save_tensors(d / "final.safetensors", result.state_dict,
                                                          {"run_id": cfg.run_id})}
        if result.snapshots:
            (d / "snapshots").mkdir(exist_ok=True)
            for step, weights in result.snapshots:
                name = f"snapshots/step_{step:07d}.safetensors"
                sums[name] = _atomic_save_tensors(d / name, weights, {"step": step})
        sums["summary.json"] = _atomic_write_bytes(d / "summary.json",
                                                   json.dumps(result.summary, indent=2, sort_keys=True).encode())
        now = time.time()
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute(
                    "INSERT INTO runs(run_id, status, task, path, seed, model, config, summary, owner, created, updated)"
                    " VALUES(?, 'done', ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT(run_id) DO UPDATE SET status='done', summary=excluded.summary, error=NULL,"
                    " updated=excluded.updated",
                    (cfg.run_id, cfg.task.name, cfg.path.name, cfg.seed, _model_label(cfg),
                     json.dumps(cfg.canonical(), sort_keys=True), json.dumps(result.summary), self.owner, now, now))
                db.execute("DELETE FROM files WHERE run_id=?", (cfg.run_id,))
                db.executemany("INSERT INTO files(run_id, name, sha256, size) VALUES(?, ?, ?, ?)",
                               [(cfg.run_id, name, h, n) for name, (h, n) in sums.items()])
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        (d / "checkpoint.safetensors").unlink(missing_ok=True)

    def file_checksums(self, run_id: str) -> dict[str, tuple[str, int]]:
        """{file name relative to the run directory: (SHA-256, size)} recorded when the run was saved."""
        with self._connect() as db:
            rows = db.execute("SELECT name, sha256, size FROM files WHERE run_id=?", (run_id,)).fetchall()
        return {r["name"]: (r["sha256"], r["size"]) for r in rows}

    def record_failure(self, cfg: RunConfig, error: str) -> None:
        now = time.time()
        with self._connect() as db:
            db.execute(
                "INSERT INTO runs(run_id, status, task, path, seed, model, config, error, owner, created, updated)"
                " VALUES(?, 'failed', ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(run_id) DO UPDATE SET status='failed', error=excluded.error, updated=excluded.updated",
                (cfg.run_id, cfg.task.name, cfg.path.name, cfg.seed, _model_label(cfg),
                 json.dumps(cfg.canonical(), sort_keys=True), error, self.owner, now, now))

    def record_engine_error(self, run_ids: list[str], error: str) -> None:
        """Keep the exception (with traceback) of a group engine that failed on ``run_ids`` (the sweep
        then retrains them alone, so the runs' own rows would not show it)."""
        with self._connect() as db:
            db.execute("INSERT INTO engine_errors(run_ids, error, owner, created) VALUES(?, ?, ?, ?)",
                       (json.dumps(list(run_ids)), error, self.owner, time.time()))

    def engine_errors(self) -> list[dict]:
        """Recorded group engine failures, oldest first: {run_ids, error, owner, created}."""
        with self._connect() as db:
            rows = db.execute("SELECT run_ids, error, owner, created FROM engine_errors ORDER BY id").fetchall()
        return [{**dict(r), "run_ids": json.loads(r["run_ids"])} for r in rows]

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, run_id: str, ckpt: dict) -> None:
        d = self.run_dir(run_id)
        d.mkdir(parents=True, exist_ok=True)
        for step, weights in ckpt.get("snapshots", []):  # snapshots so far survive a kill too
            f = d / "snapshots" / f"step_{step:07d}.safetensors"
            if not f.exists():
                f.parent.mkdir(exist_ok=True)
                _atomic_save_tensors(f, weights, {"step": step})
        _atomic_save_tensors(d / "checkpoint.safetensors", ckpt["tensors"], {"meta": ckpt["meta"]})
        self.heartbeat(run_id)

    def load_checkpoint(self, run_id: str) -> dict | None:
        f = self.run_dir(run_id) / "checkpoint.safetensors"
        if not f.exists():
            return None
        try:
            from safetensors import safe_open
            with safe_open(str(f), framework="pt") as sf:
                meta = json.loads(sf.metadata()["meta"])
            snaps = sorted((d / "snapshots").glob("step_*.safetensors")) if (d := self.run_dir(run_id)).exists() else []
            snapshots = [(int(g.stem.split("_")[1]), load_file(str(g))) for g in snaps]
            return {"tensors": load_file(str(f)), "meta": meta,
                    "snapshots": [(st, w) for st, w in snapshots if st <= meta["step"]]}
        except (SafetensorError, KeyError, ValueError, OSError):
            return None  # a corrupt checkpoint is ignored: the run restarts from scratch

    # ------------------------------------------------------------------ reading
    def _row(self, run_id: str):
        if not run_id:
            raise RunNotFoundError(f"empty run id {run_id!r}; give a run id or a prefix of one")
        with self._connect() as db:
            rows = db.execute("SELECT * FROM runs WHERE substr(run_id, 1, ?) = ?", (len(run_id), run_id)).fetchall()
        if not rows:
            raise RunNotFoundError(f"run {run_id!r} not found in store {str(self.root)!r}")
        if len(rows) > 1:
            raise RunNotFoundError(f"run id prefix {run_id!r} is ambiguous: {', '.join(r['run_id'] for r in rows)}")
        return rows[0]

    def load_config(self, run_id: str) -> RunConfig:
        row = self._row(run_id)
        f = self.run_dir(row["run_id"]) / "config.json"
        try:
            return RunConfig.model_validate_json(f.read_text())
        except (OSError, ValueError) as e:
            raise StoreError(f"run {row['run_id']!r}: config.json is missing or corrupt ({type(e).__name__})") from None

    def summary(self, run_id: str) -> dict:
        row = self._row(run_id)
        if row["status"] != "done":
            raise RunNotFoundError(f"run {row['run_id']!r} is {row['status']}, not done")
        return json.loads(row["summary"])

    def metrics(self, run_id: str) -> list[dict]:
        row = self._row(run_id)
        f = self.run_dir(row["run_id"]) / "metrics.jsonl"
        return [json.loads(l) for l in f.read_text().splitlines() if l.strip()]

    def load_state(self, run_id: str) -> dict[str, torch.Tensor]:
        row = self._row(run_id)
        f = self.run_dir(row["run_id"]) / "final.safetensors"
        if row["status"] != "done":
            raise RunNotFoundError(f"run {row['run_id']!r} is {row['status']}, not done")
        try:
            return load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise StoreError(f"run {row['run_id']!r}: final.safetensors is missing or corrupt ({e})") from None

    def load_snapshots(self, run_id: str) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """(step, weights) for every stored snapshot of a finished run, in step order."""
        row = self._row(run_id)
        d = self.run_dir(row["run_id"]) / "snapshots"
        out = []
        for f in sorted(d.glob("step_*.safetensors")) if d.exists() else []:
            try:
                out.append((int(f.stem.split("_")[1]), load_file(str(f))))
            except (SafetensorError, OSError, ValueError) as e:
                raise StoreError(f"run {row['run_id']!r}: snapshot {f.name} is corrupt ({e})") from None
        return out

    def load_model(self, run_id: str):
        """(RunConfig, model with the final weights) for a finished run."""
        from .model import build_model
        cfg = self.load_config(run_id)
        model = build_model(cfg)
        try:
            model.load_state_dict(self.load_state(run_id))
        except RuntimeError as e:
            raise StoreError(f"run {cfg.run_id!r}: checkpoint does not match its config ({str(e)[:200]})") from None
        model.eval()
        return cfg, model

    def rows(self) -> list[dict]:
        with self._connect() as db:
            return [dict(r) for r in db.execute("SELECT * FROM runs ORDER BY created")]


def load_results(store: str | os.PathLike | RunStore = "runs"):
    """A pandas DataFrame with one row per finished run: config fields (flattened) plus summary."""
    import pandas as pd

    st = store if isinstance(store, RunStore) else RunStore(store)
    records = []
    for r in st.rows():
        if r["status"] != "done":
            continue
        cfg = json.loads(r["config"])
        flat = pd.json_normalize(cfg, sep=".").iloc[0].to_dict()
        rec = {"run_id": r["run_id"], "status": r["status"], "model": r["model"], **flat}
        rec.update(json.loads(r["summary"]))
        records.append(rec)
    return pd.DataFrame.from_records(records)
