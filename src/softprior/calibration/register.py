"""Pre-registration: a calibration record fixes the task design and initialisation *before* any
prediction row of that configuration is trained (docs/DESIGN.md, "Calibration").

``make_record`` writes a record of the calibration search's choice. What a record is, its hash, its
verification, its age and the shipped records live in ``softprior.preregistration`` (read by ``config`` for a
task's defaults); the store's records and its clock in ``softprior.store.record_clock``.
"""

from __future__ import annotations

import json
import time

from ..preregistration import HASH_SCHEME, record_hash

__all__ = ["make_record"]


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
