"""Pre-registration: a calibration record fixes the task design and initialisation *before* any
prediction row of that configuration is trained (issue 14).

A record holds the chosen candidate's task and model options, the criteria it was chosen by, what
they measured, a content hash and a UTC timestamp. Records live in the run store
(``STORE/calibration/<hash>.json``) and, for the package defaults, in the package
(``softprior/calibration/registered/<task>.json``, copied there by ``softprior calibrate --register``
with ``--ship``). ``make_run_config`` builds a task's default run from its shipped record.

The store refuses to train a *prediction row* (any path other than the difficulty rows) of the
soft-prior model whose calibration key (task options and initialisation fields; not sizes, not
training settings, not Markov's p) no record covers: ``check_calibrated`` raises
``CalibrationMissing`` naming the run. Exploratory runs pass ``require_calibration=False``.
"""

from __future__ import annotations

import hashlib
import json
import time
from importlib import resources
from pathlib import Path
from typing import Iterable

__all__ = ["covering_records", "calibration_key", "make_record", "save_record", "store_records", "shipped_records",
           "find_record", "check_calibrated", "CalibrationMissing", "DIFFICULTY_PATHS", "default_options"]

DIFFICULTY_PATHS = {"unforced", "forced_zero"}
_INIT_FIELDS = ("embed_init_std", "content_rank", "content_init_std", "gate_granularity", "gate_logit_init",
                "prior_init", "prior_layers", "prior_scale", "prior_cap")
_ROW_FIELDS = {"p"}  # task options that differ between the rows of one candidate


class CalibrationMissing(RuntimeError):
    pass


def _canon(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def calibration_key(cfg) -> str:
    """What a calibration fixes for a run config: its task options (less row options) and init fields."""
    t = {k: v for k, v in cfg.task.model_dump(mode="json").items() if k not in _ROW_FIELDS}
    m = cfg.model.model_dump(mode="json")
    return _canon({"task": t, "init": {k: m[k] for k in _INIT_FIELDS}})


def make_record(space, task_options: dict, model_options: dict, keys: list[str], measured: dict,
                passes: bool, note: str = "") -> dict:
    from .criteria import criteria_for
    body = {"task": space.task, "space": space.name, "space_digest": space.digest,
            "task_options": task_options, "model_options": _jsonable(model_options),
            "keys": sorted(set(keys)), "criteria": [c.describe() for c in criteria_for(space.task)],
            "measured": measured, "passes": passes, "note": note}
    body["hash"] = hashlib.sha256(_canon(body).encode()).hexdigest()[:16]
    body["registered_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return body


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def save_record(root: str | Path, record: dict) -> Path:
    d = Path(root) / "calibration"
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{record['task']}-{record['hash']}.json"
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(p)
    return p


def store_records(root: str | Path) -> list[dict]:
    d = Path(root) / "calibration"
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.is_dir() else []


def _shipped_files():
    root = resources.files("softprior.calibration") / "registered"
    return sorted((f for f in root.iterdir() if str(f).endswith(".json")), key=str)


def shipped_records() -> dict[str, dict]:
    """The package's pre-registered default per task (``registered/TASK.json``)."""
    out = {}
    for f in _shipped_files():
        rec = json.loads(f.read_text())
        if Path(str(f)).stem == rec["task"]:
            out[rec["task"]] = rec
    return out


def all_shipped_records() -> list[dict]:
    """Every record the package ships: the defaults and superseded ones (``legacy-TASK.json``), which
    stay registered so that the runs made under them remain reproducible."""
    return [json.loads(f.read_text()) for f in _shipped_files()]


def default_options(task: str) -> tuple[dict, dict]:
    """(task_options, model_options) of a task's shipped pre-registered default (empty if none)."""
    rec = shipped_records().get(task)
    if rec is None:
        return {}, {}
    m = {k: tuple(v) if k == "prior_layers" else v for k, v in rec["model_options"].items()}
    return dict(rec["task_options"]), m


def find_record(cfg, records: Iterable[dict]) -> dict | None:
    key = calibration_key(cfg)
    for r in records:
        if key in r.get("keys", ()):
            return r
    return None


def needs_record(cfg) -> bool:
    return (cfg.path.name not in DIFFICULTY_PATHS and cfg.model.prior and cfg.model.positional == "none"
            and cfg.task.name in ("assoc_recall", "markov", "linear_icl"))


def covering_records(cfgs, root: str | Path) -> dict[str, str | None]:
    """Run id -> hash of the calibration record covering its configuration (None if none does)."""
    records = [*all_shipped_records(), *store_records(root)]
    out = {}
    for c in cfgs:
        rec = find_record(c, records)
        out[c.run_id] = rec["hash"] if rec else None
    return out


def check_calibrated(cfgs, root: str | Path) -> dict[str, str]:
    """Run id -> record hash for every prediction row; raises ``CalibrationMissing`` for the first
    one no record covers."""
    rows = [c for c in cfgs if needs_record(c)]
    covered = covering_records(rows, root)
    for c in rows:
        if covered[c.run_id] is None:
            raise CalibrationMissing(
                f"run {c.run_id} ({c.task.name}, {c.path.name}) is a prediction row, and no calibration record "
                f"covers its task and initialisation; pre-register one with `softprior calibrate "
                f"{c.task.name} --register`, or train it as exploratory (--exploratory)")
    return covered
