"""The store's calibration records and its clock: the files of ``STORE/calibration`` (written by
``save_record`` alone, read by ``record_files`` / ``store_records``) and the judgement of a record
against the store's runs (the record itself, its hash and the shipped records: ``softprior.preregistration``).

A record cannot vouch for its own time, so the store keeps one: its index notes when it first saw
each record's hash (table ``record_sightings``, append-only), and every finished run the hash of the
record it ran under (column ``runs.record``). A run is covered only by a record the store saw before
the run started (``covering_records``); a store record that covers a prediction row already in the
store is refused (``RecordRefused``, one line naming the file). ``check_calibrated`` refuses to train
a prediction row that no such record covers (``CalibrationMissing``).
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import Iterable

from ..config import RunConfig
from ..preregistration import (DIFFICULTY_PATHS, REGISTERED, CalibrationMissing, RecordRefused, age_problems,
                       all_shipped_records, calibration_key, find_record, late_record_reason, needs_record, read_record,
                       record_keys, shipped_files, verify_record)
from .index import RunIndex

__all__ = ["save_record", "record_files", "store_records", "usable_records", "covering_records", "verify_named",
           "check_calibrated", "rows_started_before", "calibration_dir", "first_rows", "check_ages"]


def calibration_dir(root: str | Path) -> Path:
    """``STORE/calibration``: the store's records (and the calibration search's other files)."""
    return Path(root) / "calibration"


def save_record(root: str | Path, record: dict) -> Path:
    """Write a (verified) record into the store at ``root``; the store's index notes that it has seen
    it. Refused (``RecordRefused``) if a prediction row it covers is already in the store."""
    d = calibration_dir(root)
    p = d / f"{record['task']}-{record['hash']}.json"
    verify_record(record, str(p))
    index = _index(root)
    if index is not None:
        _sight(index, [(str(p), record, False)])
    d.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    tmp.replace(p)
    return p


def record_files(root: str | Path) -> list[Path]:
    """The files of ``STORE/calibration`` that hold records: JSON objects with a hash or keys, and files
    that cannot be read (the search's other files there are not records)."""
    d = calibration_dir(root)
    out = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            obj = json.loads(p.read_text())
        except (OSError, ValueError):
            obj = {"keys": None}  # unreadable: refused by read_record
        if isinstance(obj, dict) and ("hash" in obj or "keys" in obj):
            out.append(p)
    return out


def _store_files(root: str | Path) -> list[tuple[str, dict]]:
    """(file, record) of every record in ``STORE/calibration`` (``record_files``), verified."""
    return [(str(p), read_record(p)) for p in record_files(root)]


def store_records(root: str | Path) -> list[dict]:
    """The records of the store at ``root``, each verified (``RecordRefused`` naming a file that is not)."""
    return [r for _, r in _store_files(root)]


# ------------------------------------------------------------------------------------ the store's clock
def _index(root: str | Path):
    """The index of the store at ``root`` (None where there is no store: nothing is created)."""
    if not (Path(root) / "index.sqlite").is_file():
        return None
    return RunIndex(Path(root), f"{socket.gethostname()}:{os.getpid()}")


def _row_config(row: dict):
    try:
        return RunConfig.model_validate(json.loads(row["config"]))
    except ValueError:
        return None


def rows_started_before(rows: Iterable[dict], rec: dict, seen: float | None) -> list[str]:
    """The run ids of the prediction rows among ``rows`` (index rows of runs committed under the store's
    clock: ``record`` not NULL) that ``rec`` covers and that started before ``seen`` (None: ever)."""
    keys, out = record_keys(rec), []
    for r in rows:
        if r.get("record") is None or r.get("path") in DIFFICULTY_PATHS or r.get("task") != rec.get("task"):
            continue
        if seen is not None and not (r.get("created") or 0.0) < seen:
            continue
        cfg = _row_config(r)
        if cfg is not None and needs_record(cfg) and calibration_key(cfg) in keys:
            out.append(r["run_id"])
    return out


def _sight(index, found: list[tuple[str, dict, bool]]) -> dict[str, float]:
    """Note in ``index`` each record of ``found`` (file, record, shipped) it has not seen before, after
    refusing a store record that covers a prediction row already in the store; returns hash -> first seen."""
    seen = index.record_sightings()
    new = [(w, r, shipped) for w, r, shipped in found if r["hash"] not in seen]
    if not new:
        return seen
    rows = index.rows()
    for where, rec, shipped in new:
        if shipped:  # the package's records: git is their clock (git_clock_problems)
            continue
        early = rows_started_before(rows, rec, None)
        if early:
            raise RecordRefused(where, late_record_reason(early[0]))
    return index.see_records({r["hash"]: w for w, r, _ in new})


def usable_records(root: str | Path, index=None) -> tuple[list[dict], dict[str, float]]:
    """(every record the package ships and the store at ``root`` holds, each verified; hash -> when the
    store first saw it, empty without a store). Records the store sees for the first time are noted,
    and one that covers a prediction row already in the store is refused (``RecordRefused``)."""
    found = [(str(f), read_record(f), True) for f in shipped_files()]
    found += [(w, r, False) for w, r in _store_files(root)]
    index = index if index is not None else _index(root)
    seen = _sight(index, found) if index is not None else {}
    return [r for _, r, _ in found], seen


def covering_records(cfgs, root: str | Path) -> dict[str, str | None]:
    """Run id -> hash of the calibration record covering its configuration (None if none does): the
    first verified record whose keys hold it and, for a prediction row, that the store saw before the
    row started (a row not yet in the store starts later)."""
    index = _index(root)
    records, seen = usable_records(root, index)
    rows = [c.run_id for c in cfgs if needs_record(c)]
    started = index.started(rows) if index is not None and rows else {}
    out = {}
    for c in cfgs:
        t = started.get(c.run_id)
        ok = [r for r in records if t is None or seen.get(r["hash"], math.inf) <= t]
        rec = find_record(c, ok)
        out[c.run_id] = rec["hash"] if rec else None
    return out


def verify_named(source, hashes: Iterable[str | None]) -> dict[str, dict]:
    """For a report: the records its runs name (hash -> record; None and '' skipped), every record of
    the package and of ``source`` verified on the way (``RecordRefused`` naming a file that does not
    verify); ``CalibrationMissing`` for a named hash that no valid record holds. ``source``: a store's
    root, or a report's source (a run store or a results bundle: its ``calibration_records()``). Reads only."""
    own = source.calibration_records() if hasattr(source, "calibration_records") else store_records(source)
    held = {}
    for r in [*all_shipped_records(), *own]:
        held.setdefault(r["hash"], r)
    out = {}
    for h in hashes:
        if not h:
            continue
        if h not in held:
            where = getattr(source, "root", source)
            raise CalibrationMissing(f"calibration record {h}, named by a run, is held by neither the package nor "
                                     f"{str(where)!r}: its runs cannot count as calibrated")
        out[h] = held[h]
    if out:  # each named record's age, against the first prediction row the source holds under it
        if hasattr(source, "record_first_rows"):  # a results bundle: its manifest says (``bundle.py``)
            known = source.record_first_rows(out)
        else:
            root = Path(getattr(source, "root", source))  # a store, a bundle being written, or a root
            index = RunIndex(root, "reader", read_only=True) if (root / "index.sqlite").is_file() else None
            known = first_rows(index.rows()) if index is not None else {}
        own_files = [(f"{h}.json", r) for h, r in held.items() if r in own]
        check_ages({h: known.get(h) for h in out}, own_files)
    return out


def check_calibrated(cfgs, root: str | Path) -> dict[str, str]:
    """Run id -> record hash for every prediction row; raises ``CalibrationMissing`` for the first
    one no record covers, and ``RecordRefused`` for a shipped record covering one that does not prove
    its age (``check_ages``: in a git checkout, committed with its present content no later than the
    first prediction row it covers, and no earlier than its ``registered_at``)."""
    rows = [c for c in cfgs if needs_record(c)]
    covered = covering_records(rows, root)
    for c in rows:
        if covered[c.run_id] is None:
            raise CalibrationMissing(
                f"run {c.run_id} ({c.task.name}, {c.path.name}) is a prediction row, and no calibration record "
                f"the store saw before it started covers its task and initialisation; pre-register one with "
                f"`softprior calibrate {c.task.name} --register`, or train it as exploratory (--exploratory)")
    used = {h for h in covered.values() if h}
    if used:
        index = _index(root)
        known = first_rows(index.rows()) if index is not None else {}
        check_ages({h: known.get(h) for h in used})  # rows not yet in the store start now
    return covered


def first_rows(rows: Iterable[dict]) -> dict[str, float]:
    """Record hash -> the start time (``created``) of the first finished prediction row that ran under it,
    from index rows (``RunIndex.rows``; runs from before the store's clock name none)."""
    out: dict[str, float] = {}
    for r in rows:
        h = r.get("record")
        if not h or r.get("status") != "done" or r.get("path") in DIFFICULTY_PATHS:
            continue
        cfg = _row_config(r)
        if cfg is not None and needs_record(cfg):
            out[h] = min(out.get(h, float("inf")), float(r.get("created") or 0.0))
    return out


def check_ages(first: dict[str, float | None], own: Iterable[tuple[str, dict]] = ()) -> None:
    """``RecordRefused`` (one line naming the file) for the first record among the package's (and
    ``own``: (file, record) pairs, a store's or a bundle's) whose age ``preregistration.age_problems`` refuses,
    for the hashes of ``first`` (hash -> its first prediction row's start, None: none yet)."""
    shipped = [(f"{REGISTERED}/{Path(str(f)).name}", read_record(f)) for f in shipped_files()]
    problems = age_problems(first, [*shipped, *own])
    if problems:
        raise RecordRefused(*problems[0])
