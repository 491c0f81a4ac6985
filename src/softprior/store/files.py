"""The run store's files: one directory per run, every file written to a temporary name and
renamed into place (so a killed process leaves a whole file or none), weights in safetensors (never
pickle). Nothing here touches the index."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..config import RunConfig
from .errors import StoreDamagedError, StoreReadOnlyError

__all__ = ["RunFiles", "sha256_file"]


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


GROUP_CHECKPOINT = "group_checkpoint.safetensors"
CRASH_MARKER = "crashed"  # a job kept its checkpoint after crashing once (``note_crash``)


_UNREADABLE = (SafetensorError, KeyError, ValueError, OSError, TypeError)


def _read_meta(f: Path) -> dict | None:
    """The ``meta`` of a checkpoint file (only its header is read); None if missing or unreadable."""
    if not f.exists():
        return None
    try:
        from safetensors import safe_open
        with safe_open(str(f), framework="pt") as sf:
            return json.loads(sf.metadata()["meta"])
    except _UNREADABLE:
        return None


def _read_checkpoint(f: Path) -> dict | None:
    """{"tensors", "meta"} of a checkpoint file; None if it is missing or unreadable (a corrupt
    checkpoint is ignored: its runs restart from scratch)."""
    meta = _read_meta(f)
    if meta is None:
        return None
    try:
        return {"tensors": load_file(str(f)), "meta": meta}
    except _UNREADABLE:
        return None


class RunFiles:
    """``read_only``: every method that would write raises ``StoreReadOnlyError`` first."""

    def __init__(self, root: Path, read_only: bool = False):
        self.root, self.read_only = Path(root), read_only

    def run_dir(self, run_id: str) -> Path:
        return self.root / "runs" / run_id

    def _writable(self) -> None:
        if self.read_only:
            raise StoreReadOnlyError.at(self.root)

    def _damaged(self, run_id: str, what: str) -> StoreDamagedError:
        return StoreDamagedError(f"run {run_id!r}: {what}; `softprior store verify --store {str(self.root)!r}` "
                                 "checks every run, and with --repair re-queues the damaged ones")

    def write_result(self, result) -> dict[str, tuple[str, int]]:
        """Write a finished run's files; return {name: (SHA-256, size)} of every file written."""
        self._writable()
        cfg = result.config
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
        return sums

    # A checkpoint is scratch state while a run trains: ``checkpoint.safetensors`` for a single run;
    # for a group (engine.train_group), ``group_checkpoint.safetensors`` in its first run's directory,
    # whose metadata names the group's runs in order. Sweep workers write these files (never the index).
    def drop_checkpoint(self, run_id: str) -> None:
        self._writable()
        for name in ("checkpoint.safetensors", GROUP_CHECKPOINT, CRASH_MARKER):
            (self.run_dir(run_id) / name).unlink(missing_ok=True)

    def note_crash(self, run_id: str) -> bool:
        """Note that the job whose checkpoint lives in ``run_id``'s directory crashed; returns whether it
        had crashed before (then the caller drops the checkpoint, so the next sweep may regroup)."""
        self._writable()
        marker = self.run_dir(run_id) / CRASH_MARKER
        if marker.exists():
            marker.unlink()
            return True
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("crashed\n")
        return False

    def save_checkpoint(self, run_id: str, ckpt: dict) -> None:
        self._writable()
        d = self.run_dir(run_id)
        d.mkdir(parents=True, exist_ok=True)
        for step, weights in ckpt.get("snapshots", []):  # snapshots so far survive a kill too
            f = d / "snapshots" / f"step_{step:07d}.safetensors"
            if not f.exists():
                f.parent.mkdir(exist_ok=True)
                _atomic_save_tensors(f, weights, {"step": step})
        _atomic_save_tensors(d / "checkpoint.safetensors", ckpt["tensors"], {"meta": ckpt["meta"]})

    def load_checkpoint(self, run_id: str) -> dict | None:
        ck = _read_checkpoint(self.run_dir(run_id) / "checkpoint.safetensors")
        if ck is not None and ck["meta"].get("run_ids") != [run_id]:
            # an older format (before loop.train was the K = 1 loop): the run restarts from scratch, so
            # the snapshots that checkpoint kept go with it
            self.drop_checkpoint(run_id)
            shutil.rmtree(self.run_dir(run_id) / "snapshots", ignore_errors=True)
            return None
        if ck is not None:
            try:
                d = self.run_dir(run_id)
                snaps = sorted((d / "snapshots").glob("step_*.safetensors"))
                snapshots = [(int(g.stem.split("_")[1]), load_file(str(g))) for g in snaps]
            except (SafetensorError, ValueError, OSError):
                return None  # a corrupt snapshot: the run restarts from scratch
            ck["snapshots"] = [(st, w) for st, w in snapshots if st <= ck["meta"]["step"]]
        return ck

    def save_group_checkpoint(self, run_ids: list[str], ckpt: dict) -> None:
        self._writable()
        d = self.run_dir(run_ids[0])
        d.mkdir(parents=True, exist_ok=True)
        _atomic_save_tensors(d / GROUP_CHECKPOINT, ckpt["tensors"], {"meta": {**ckpt["meta"], "run_ids": list(run_ids)}})

    def load_group_checkpoint(self, run_ids: list[str]) -> dict | None:
        """The checkpoint of exactly this group (these runs, in this order), or None."""
        ck = _read_checkpoint(self.run_dir(run_ids[0]) / GROUP_CHECKPOINT)
        return ck if ck is not None and ck["meta"].get("run_ids") == list(run_ids) else None

    def checkpointed_group(self, run_id: str) -> list[str] | None:
        """The runs of the group checkpoint kept in ``run_id``'s directory (only its metadata is read)."""
        meta = _read_meta(self.run_dir(run_id) / GROUP_CHECKPOINT)
        ids = meta.get("run_ids") if isinstance(meta, dict) else None
        return list(ids) if isinstance(ids, list) and ids and ids[0] == run_id else None

    def read_config(self, run_id: str) -> RunConfig:
        f = self.run_dir(run_id) / "config.json"
        try:
            return RunConfig.model_validate_json(f.read_text())
        except (OSError, ValueError) as e:
            raise self._damaged(run_id, f"config.json is missing or corrupt ({type(e).__name__})") from None

    def read_metrics(self, run_id: str) -> list[dict]:
        f = self.run_dir(run_id) / "metrics.jsonl"
        try:
            return [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
        except (OSError, ValueError) as e:
            raise self._damaged(run_id, f"metrics.jsonl is missing or corrupt ({type(e).__name__})") from None

    def read_state(self, run_id: str) -> dict[str, torch.Tensor]:
        try:
            return load_file(str(self.run_dir(run_id) / "final.safetensors"))
        except (SafetensorError, OSError, ValueError) as e:
            raise self._damaged(run_id, f"final.safetensors is missing or corrupt ({e})") from None

    def read_snapshots(self, run_id: str) -> list[tuple[int, dict[str, torch.Tensor]]]:
        d = self.run_dir(run_id) / "snapshots"
        out = []
        for f in sorted(d.glob("step_*.safetensors")) if d.exists() else []:
            try:
                out.append((int(f.stem.split("_")[1]), load_file(str(f))))
            except (SafetensorError, OSError, ValueError) as e:
                raise self._damaged(run_id, f"snapshot {f.name} is corrupt ({e})") from None
        return out
