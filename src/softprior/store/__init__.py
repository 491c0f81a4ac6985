"""The embedded run store: a SQLite index plus one directory per run.

    STORE/index.sqlite            runs(run_id, status, task, path, seed, model, config, summary, error, ...)
                                  engine_errors(run_ids, error, ...): group engine exceptions, with traceback
                                  files(run_id, name, sha256, size): checksums of every file a run wrote
                                  ledger(kind, name, seconds, flop, ...): the time ledger, append-only
    STORE/runs/RUN_ID/config.json
    STORE/runs/RUN_ID/metrics.jsonl
    STORE/runs/RUN_ID/final.safetensors      model weights (safetensors: never pickle)
    STORE/runs/RUN_ID/summary.json
    STORE/runs/RUN_ID/snapshots/step_N.safetensors  weights during training (mechanism traces)
    STORE/runs/RUN_ID/checkpoint.safetensors resumable state while a run is in progress
    STORE/calibration/TASK-HASH.json         calibration records (``records``: the store's clock)
    STORE/calibration/*.json                 the calibration search's other files (``write_calibration_file``)
    STORE/optuna.sqlite3                     the calibration search's Optuna study (``optuna_url``)
    STORE/analysis_cache/NAME                analyses a report reads back (``write_cache``, ``cache_path``)

Runs are keyed by a hash of their canonical config (``RunConfig.run_id``). Every file is written to a
temporary name and renamed into place; only then is the run committed as done in SQLite, so a killed
process leaves either a complete run or none. The SHA-256 and size of every file a finished run
wrote are recorded in the ``files`` table in the same transaction (``softprior store verify`` checks
them, see ``softprior.store.integrity``). SQLite runs in WAL mode with a busy timeout; runs are
claimed in an IMMEDIATE transaction so that two processes never train the same run.

Layout of the code: ``index`` (``RunIndex``: SQLite, leases, checksums, engine errors), ``files``
(``RunFiles``: run directories, safetensors, checkpoints, snapshots), ``records`` (the calibration
records of ``STORE/calibration`` and the store's clock), ``integrity`` (``softprior store verify``), and
``RunStore`` here, which puts them together (files first, then the index commit) and builds models
from stored weights. Every file under the store is written by this package, through ``RunStore``'s
public methods: no other module writes there or calls a private function of it.

A store can be read where it cannot be written (shared read-only, on a read-only mount): opened
read-only, it creates nothing, writes nothing (the index through ``index.connect_read_only``), and a
write raises ``StoreReadOnlyError``. The commands that only read (eval, report, export, store verify)
open it so; ``RunStore(root)`` does when the store exists and its directory cannot be written.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from ..config import RunConfig
from .errors import RunNotFoundError, StoreDamagedError, StoreError, StoreNotFoundError, StoreReadOnlyError
from .files import RunFiles, _atomic_write_bytes
from .index import RunIndex
from .record_clock import calibration_dir, check_calibrated, covering_records, save_record, store_records

__all__ = ["RunStore", "load_results"]


class RunStore:
    """The run store: an index (``RunIndex``) and the runs' files (``RunFiles``) under one root.

    ``read_only``: True opens an existing store for reading only (``StoreNotFoundError`` if there is
    none: reading never creates a store); False needs a writable store, created if missing; None (the
    default) is False unless the store exists and its directory cannot be written (then True)."""

    def __init__(self, root: str | os.PathLike = "runs", *, read_only: bool | None = None):
        self.root = Path(root)
        exists = (self.root / "index.sqlite").is_file()
        if read_only is None:
            read_only = exists and not os.access(self.root, os.W_OK)
        self.read_only = read_only
        if read_only:
            if not exists:
                raise StoreNotFoundError(
                    f"no run store at {str(self.root)!r} (no index.sqlite there); check --store, or create one "
                    "with `softprior train` or `softprior reproduce`")
        else:
            try:
                (self.root / "runs").mkdir(parents=True, exist_ok=True)
                probe = self.root / f".write-probe-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as e:
                raise StoreError(f"store directory {str(self.root)!r} cannot be written: {e.strerror}") from None
        self.index = RunIndex(self.root, f"{socket.gethostname()}:{os.getpid()}", read_only=read_only)
        self.files = RunFiles(self.root, read_only=read_only)

    @property
    def owner(self) -> str:
        """'host:pid' of the process whose claims this store makes (the index holds it)."""
        return self.index.owner

    @owner.setter
    def owner(self, value: str) -> None:
        self.index.owner = value

    # ------------------------------------------------------------------ the index
    def status(self, run_id: str) -> str | None:
        return self.index.status(run_id)

    def is_done(self, run_id: str) -> bool:
        return self.index.is_done(run_id)

    def claim(self, cfg: RunConfig) -> bool:
        """Atomically mark ``cfg`` as running by this process. False if done or held by a live owner."""
        return self.index.claim(cfg)

    def heartbeat(self, run_id: str | None = None) -> None:
        """Refresh this process's claim on ``run_id``, or (None) on every run it holds."""
        self.index.heartbeat(run_id)

    def release(self, run_id: str) -> None:
        """Drop this process's claim on an unfinished run (e.g. on Ctrl-C)."""
        self.index.release(run_id)

    def file_checksums(self, run_id: str) -> dict[str, tuple[str, int]]:
        return self.index.file_checksums(run_id)

    def record_failure(self, cfg: RunConfig, error: str) -> None:
        self.index.record_failure(cfg, error)

    def record_engine_error(self, run_ids: list[str], error: str) -> None:
        self.index.record_engine_error(run_ids, error)

    def engine_errors(self) -> list[dict]:
        return self.index.engine_errors()

    def rows(self) -> list[dict]:
        return self.index.rows()

    def record_timing(self, kind: str, name: str, seconds: float, flop: float = 0.0, runs: int = 0,
                      started_at: float | None = None, host: str | None = None, code_version: str | None = None,
                      gemm_gflops: float | None = None, detail: dict | None = None) -> None:
        """Append a row to the time ledger (table ``ledger``, append-only): the wall ``seconds`` of a
        ``kind`` = "job" (one run or a group trained together; a job resumed from checkpoints counts each
        piece), "report" or "sweep" (one ``executors.sweep.execute`` call, the driver's whole wall time), the
        ``flop`` it trained (``flops.train_step_flops`` x steps, summed over its ``runs``), when it
        started (unix time), the host, the code version (``provenance.code_version``), the GEMM rate the
        sweep measured (``flops.gemm_rate``, GFLOP/s), and a JSON-able ``detail`` (run ids, pieces, ...).
        Written by the sweep driver alone (workers return their timing); ``softprior report timings``
        reads it (``reports.timings.ledger_summary``)."""
        self.index.record_timing(kind, name, seconds, flop, runs, started_at, host, code_version, gemm_gflops, detail)

    def ledger(self) -> list[dict]:
        """The time ledger's rows, oldest first (``record_timing``'s fields, ``detail`` decoded)."""
        return self.index.ledger()

    def _row(self, run_id: str):
        return self.index.row(run_id)

    # ------------------------------------------------------------------ files, then the index
    def run_dir(self, run_id: str) -> Path:
        return self.files.run_dir(run_id)

    def save_result(self, result) -> None:
        """Write a finished run's files atomically, then commit it as done together with the SHA-256
        of every file written (table ``files``). The summary names the calibration record that covers
        the run's configuration (``covering_records``; None if none does)."""
        cfg = result.config
        result.summary.setdefault("calibration", self.covering_records([cfg])[cfg.run_id])
        sums = self.files.write_result(result)
        self.index.commit_done(cfg, result.summary, sums)
        self.files.drop_checkpoint(cfg.run_id)

    def forget(self, run_ids: list[str]) -> None:
        """Delete the index rows of ``run_ids`` (re-queued: the next sweep trains them again)."""
        self.index.forget(run_ids)

    def write_cache(self, name: str, data: bytes) -> Path | None:
        """Write ``STORE/analysis_cache/NAME`` atomically, for a report to read back instead of computing
        it again. A cache is no part of the store's record: it is written where the directory can be
        written (a store opened read-only by a report included) and skipped (None) where it cannot."""
        if not os.access(self.root, os.W_OK):
            return None
        f = self.root / "analysis_cache" / name
        try:
            f.parent.mkdir(exist_ok=True)
            _atomic_write_bytes(f, data)
        except OSError:  # e.g. a read-only mount that os.access did not report
            return None
        return f

    def cache_path(self, name: str) -> Path:
        """Where ``write_cache`` keeps ``name`` (``STORE/analysis_cache/NAME``), for reading it back."""
        return self.root / "analysis_cache" / name

    # ------------------------------------------------------------------ calibration
    def calibration_dir(self) -> Path:
        """``STORE/calibration``: the calibration records and the calibration search's files."""
        return calibration_dir(self.root)

    def write_record(self, record: dict) -> Path:
        """Write a calibration record (``record_clock.save_record``: verified, seen by the store's clock,
        refused if a prediction row it covers is already here)."""
        self._writable()
        return save_record(self.root, record)

    def calibration_records(self) -> list[dict]:
        """The store's calibration records, each verified (``RecordRefused`` naming a file that is not)."""
        return store_records(self.root)

    def covering_records(self, cfgs) -> dict[str, str | None]:
        """Run id -> hash of the record that covers it by the store's clock (``record_clock.covering_records``)."""
        return covering_records(cfgs, self.root)

    def check_calibrated(self, cfgs) -> dict[str, str]:
        """Run id -> record hash of every prediction row among ``cfgs``; ``CalibrationMissing`` for the first
        one no record covers (``record_clock.check_calibrated``)."""
        return check_calibrated(cfgs, self.root)

    def write_calibration_file(self, name: str, text: str) -> Path:
        """Write ``STORE/calibration/NAME`` atomically (the calibration search's own files, not records)."""
        self._writable()
        f = self.calibration_dir() / name
        f.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write_bytes(f, text.encode())
        return f

    def optuna_url(self) -> str:
        """The SQLAlchemy URL of the calibration search's Optuna study, ``STORE/optuna.sqlite3``."""
        return f"sqlite:///{(self.root / 'optuna.sqlite3').resolve()}"

    def _writable(self) -> None:
        if self.read_only:
            raise StoreReadOnlyError(f"store {str(self.root)!r} is open read-only: nothing can be written to it")

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, run_id: str, ckpt: dict) -> None:
        self.files.save_checkpoint(run_id, ckpt)
        self.index.heartbeat(run_id)

    def load_checkpoint(self, run_id: str) -> dict | None:
        return self.files.load_checkpoint(run_id)

    # ------------------------------------------------------------------ reading
    def load_config(self, run_id: str) -> RunConfig:
        return self.files.read_config(self._row(run_id)["run_id"])

    def summary(self, run_id: str) -> dict:
        import json
        row = self._row(run_id)
        if row["status"] != "done":
            raise RunNotFoundError(f"run {row['run_id']!r} is {row['status']}, not done")
        return json.loads(row["summary"])

    def metrics(self, run_id: str) -> list[dict]:
        return self.files.read_metrics(self._row(run_id)["run_id"])

    def load_state(self, run_id: str) -> dict[str, torch.Tensor]:
        row = self._row(run_id)
        if row["status"] != "done":
            raise RunNotFoundError(f"run {row['run_id']!r} is {row['status']}, not done")
        return self.files.read_state(row["run_id"])

    def load_snapshots(self, run_id: str) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """(step, weights) for every stored snapshot of a finished run, in step order."""
        return self.files.read_snapshots(self._row(run_id)["run_id"])

    def load_model(self, run_id: str):
        """(RunConfig, model with the final weights) for a finished run."""
        from ..model.transformer import build_model
        cfg = self.load_config(run_id)
        model = build_model(cfg)
        try:
            model.load_state_dict(self.load_state(run_id))
        except RuntimeError as e:
            raise StoreDamagedError(f"run {cfg.run_id!r}: its weights do not fit its config ({str(e)[:200]}); "
                                    f"`softprior store verify --store {str(self.root)!r}` checks every run, and "
                                    "with --repair re-queues the damaged ones") from None
        model.eval()
        return cfg, model


def load_results(store: str | os.PathLike | RunStore = "runs"):
    """A pandas DataFrame with one row per finished run: config fields (flattened) plus summary."""
    import json

    import pandas as pd

    st = store if isinstance(store, RunStore) else RunStore(store, read_only=True)
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
