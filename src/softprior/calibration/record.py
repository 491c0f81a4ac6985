"""Pre-registration: a calibration record fixes the task design and initialisation *before* any
prediction row of that configuration is trained (docs/DESIGN.md, "Calibration").

``make_record`` writes a record of the calibration search's choice. The rest lives below the layers
that read it, and is re-exported here for compatibility: what a record is, its hash, its
verification and the shipped records in ``softprior.records`` (read by ``config`` for a task's
defaults), the store's records and its clock in ``softprior.store.records`` (read by the store on
every saved run and by ``store verify``).
"""

from __future__ import annotations

import json
import time

from ..records import (DIFFICULTY_PATHS, HASH_SCHEME, CalibrationMissing, RecordRefused, all_shipped_records,
                       calibration_key, default_options, find_record, git_clock_problems, late_record_reason,
                       needs_record, read_record, record_hash, record_keys, shipped_files, shipped_records,
                       verify_record)
from ..store.records import (check_calibrated, covering_records, record_files, rows_started_before, save_record,
                             store_records, usable_records, verify_named)

__all__ = ["covering_records", "calibration_key", "make_record", "save_record", "store_records", "shipped_records",
           "find_record", "check_calibrated", "CalibrationMissing", "RecordRefused", "DIFFICULTY_PATHS",
           "default_options", "record_hash", "verify_record", "read_record", "usable_records", "rows_started_before",
           "record_files", "shipped_files", "late_record_reason", "needs_record", "record_keys", "verify_named",
           "git_clock_problems", "all_shipped_records",
           "HASH_SCHEME"]


def make_record(space, task_options: dict, model_options: dict, keys: list[str], measured: dict,
                passes: bool, note: str = "", extra: dict | None = None) -> dict:
    """A record of a search's choice; ``extra``: more fields it registers (an identified set's members).
    The tier assignment of the paper's rows (``tiers.tiers_spec``) is registered and hashed with it."""
    from ..claims import claims_spec
    from ..tiers import tiers_spec
    body = {**(extra or {}), "tiers": tiers_spec(), "task": space.task, "space": space.name, "space_digest": space.digest,
            "task_options": task_options, "model_options": _jsonable(model_options),
            "keys": sorted(set(keys)), "criteria": [c.describe() for c in space.criteria()],
            "measured": measured, "passes": passes, "note": note,
            # the claims' predicates are registered (and hashed) before any prediction row runs
            "claims": claims_spec()}
    body = json.loads(json.dumps(body))  # as it reads back from its file (tuples as lists), so it hashes the same
    body["registered_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    body["hash_scheme"] = HASH_SCHEME
    body["hash"] = record_hash(body)
    return body


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
