"""Pre-registration: a calibration record fixes the task design and initialisation *before* any
prediction row of that configuration is trained (issue 14).

A record holds the chosen candidate's task and model options, the criteria it was chosen by, what
they measured, a UTC timestamp and a content hash. Records live in the run store
(``STORE/calibration/<task>-<hash>.json``) and, for the package defaults, in the package
(``softprior/calibration/registered/<task>.json``, copied there by ``softprior calibrate --register``
with ``--ship``). ``make_run_config`` builds a task's default run from its shipped record.

The store refuses to train a *prediction row* (any path other than the difficulty rows) of the
soft-prior model whose calibration key (task options and initialisation fields; not sizes, not
training settings, not Markov's p) no record covers: ``check_calibrated`` raises
``CalibrationMissing`` naming the run. Exploratory runs pass ``require_calibration=False``.

Records prove themselves (issue 28):

- **The hash.** ``record_hash`` recomputes a record's hash from the record itself, by the scheme it
  names (``hash_scheme``): v2 (what ``make_record`` writes) hashes everything but the hash, so its
  content, its calibration keys and its time ``registered_at``; v1 (records without ``hash_scheme``:
  every record written before v2, the shipped ones included) hashed everything but the hash and the
  time. Each record verifies under its own scheme, so old records and the runs made under them stay
  valid (the hash is no part of a run id). Every read of a record (``read_record``: training a
  prediction row, the summary's covering record, the package defaults, ``store verify``, and
  ``verify_named`` for a report's runs) recomputes it; a mismatch (a forged or edited record) raises
  ``RecordRefused``, one line naming the file.
- **The store's clock.** A record cannot vouch for its own time, so the store keeps one: its index
  notes when it first saw each record's hash (table ``record_sightings``, append-only), and every
  finished run the hash of the record it ran under (column ``runs.record``; '' for none). A run is
  covered only by a record the store saw before the run started (its row's ``created``): a record
  placed in ``STORE/calibration/`` after a prediction row of its configuration is refused, one line
  naming the file, and never covers a run that started before it. (Runs committed before the store
  kept its clock have ``record`` NULL and are not judged by it.)
- **Git, the clock of the shipped records.** ``git_clock_problems`` checks in the repository's
  history that every table under ``docs/results/`` naming a shipped record was committed after that
  record, with the content it has now.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import subprocess
import time
from importlib import resources
from pathlib import Path
from typing import Iterable

__all__ = ["covering_records", "calibration_key", "make_record", "save_record", "store_records", "shipped_records",
           "find_record", "check_calibrated", "CalibrationMissing", "RecordRefused", "DIFFICULTY_PATHS",
           "default_options", "record_hash", "verify_record", "read_record", "usable_records", "rows_started_before",
           "record_files", "shipped_files", "late_record_reason", "needs_record", "record_keys", "verify_named",
           "git_clock_problems",
           "HASH_SCHEME"]

DIFFICULTY_PATHS = {"unforced", "forced_zero"}
_INIT_FIELDS = ("embed_init_std", "content_rank", "content_init_std", "gate_granularity", "gate_logit_init",
                "prior_init", "prior_layers", "prior_scale", "prior_cap")
_ROW_FIELDS = {"p"}  # task options that differ between the rows of one candidate

HASH_SCHEME = 2  # the scheme make_record writes
_UNHASHED = {1: ("hash", "registered_at"), 2: ("hash",)}  # per scheme: the fields its hash leaves out


class CalibrationMissing(RuntimeError):
    pass


class RecordRefused(CalibrationMissing):
    """A calibration record that does not prove itself: unreadable, its hash not its content's (forged,
    or edited after it was written), or first seen by the store after a prediction row it covers had
    started. The message is one line naming the file (``file``; ``why``: the rest)."""

    def __init__(self, file: str, why: str):
        super().__init__(f"calibration record {file}: {why}")
        self.file, self.why = file, why

    def __reduce__(self):  # (pickled across worker processes)
        return type(self), (self.file, self.why)


def _canon(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def calibration_key(cfg) -> str:
    """What a calibration fixes for a run config: its task options (less row options) and init fields,
    less the options added later at their defaults (``config.LATER_DEFAULTS``, as for run ids), so a
    record written before an option existed still covers the configurations it covered then."""
    t = {k: v for k, v in cfg.task.model_dump(mode="json").items() if k not in _ROW_FIELDS}
    m = cfg.model.model_dump(mode="json")
    return _key_form({"task": t, "init": {k: m[k] for k in _INIT_FIELDS}})


def _key_form(key) -> str:
    """A calibration key (a dict or its JSON) without the later options at their defaults."""
    from ..config import LATER_DEFAULTS
    d = json.loads(key) if isinstance(key, str) else key
    for part, defaults in (("task", LATER_DEFAULTS["task"]), ("init", LATER_DEFAULTS["model"])):
        sub = dict(d.get(part, {}))
        for k, default in defaults.items():
            if k in sub and (sub[k] in default if isinstance(default, tuple) else sub[k] == default):
                del sub[k]
        d = {**d, part: sub}
    return _canon(d)


def record_hash(rec: dict) -> str:
    """The hash of a record by the scheme it names (module docstring): v2 (``hash_scheme`` 2) covers
    everything but the hash (content, calibration keys and ``registered_at``); v1 (no ``hash_scheme``)
    everything but the hash and ``registered_at``."""
    scheme = rec.get("hash_scheme", 1)
    if scheme not in _UNHASHED:
        raise ValueError(f"unknown hash scheme {scheme!r}; known: {', '.join(map(str, _UNHASHED))}")
    body = {k: v for k, v in rec.items() if k not in _UNHASHED[scheme]}
    return hashlib.sha256(_canon(body).encode()).hexdigest()[:16]


def verify_record(rec, where: str) -> dict:
    """``rec`` if its hash is the hash of its content (``record_hash``), else ``RecordRefused`` naming
    ``where`` (the file it was read from)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("hash"), str) or not isinstance(rec.get("keys"), list):
        raise RecordRefused(where, "not a record (a JSON object with a hash and keys)")
    try:
        got = record_hash(rec)
    except ValueError as e:
        raise RecordRefused(where, str(e)) from None
    if got != rec["hash"]:
        raise RecordRefused(where, f"its hash {rec['hash']} is not the hash of its content ({got}, scheme "
                                   f"v{rec.get('hash_scheme', 1)}): it was forged or edited after it was written; "
                                   "remove it (`softprior store verify --repair` moves it aside)")
    return rec


_VERIFIED: set[tuple[str, str]] = set()  # (where, text) already verified: the package defaults are read often


def read_record(path, text: str | None = None) -> dict:
    """The record in file ``path`` (a path or package resource), verified (``verify_record``);
    ``RecordRefused`` naming the file if it cannot be read or does not verify."""
    where = str(path)
    try:
        text = path.read_text() if text is None else text
        rec = json.loads(text)
    except (OSError, ValueError) as e:
        raise RecordRefused(where, f"unreadable ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
    if (where, text) not in _VERIFIED:
        verify_record(rec, where)
        _VERIFIED.add((where, text))
    return rec


def make_record(space, task_options: dict, model_options: dict, keys: list[str], measured: dict,
                passes: bool, note: str = "") -> dict:
    from .criteria import criteria_for
    body = {"task": space.task, "space": space.name, "space_digest": space.digest,
            "task_options": task_options, "model_options": _jsonable(model_options),
            "keys": sorted(set(keys)), "criteria": [c.describe() for c in criteria_for(space.task)],
            "measured": measured, "passes": passes, "note": note}
    body = json.loads(json.dumps(body))  # as it reads back from its file (tuples as lists), so it hashes the same
    body["registered_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    body["hash_scheme"] = HASH_SCHEME
    body["hash"] = record_hash(body)
    return body


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def save_record(root: str | Path, record: dict) -> Path:
    """Write a (verified) record into the store at ``root``; the store's index notes that it has seen
    it. Refused (``RecordRefused``) if a prediction row it covers is already in the store."""
    d = Path(root) / "calibration"
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
    d = Path(root) / "calibration"
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


def shipped_files():
    """The package's record files (``registered/*.json``)."""
    return _shipped_files()


def _shipped_files():
    root = resources.files("softprior.calibration") / "registered"
    return sorted((f for f in root.iterdir() if str(f).endswith(".json")), key=str)


def shipped_records() -> dict[str, dict]:
    """The package's pre-registered default per task (``registered/TASK.json``), verified."""
    out = {}
    for f in _shipped_files():
        rec = read_record(f)
        if Path(str(f)).stem == rec["task"]:
            out[rec["task"]] = rec
    return out


def all_shipped_records() -> list[dict]:
    """Every record the package ships: the defaults and superseded ones (``legacy-TASK.json``), which
    stay registered so that the runs made under them remain reproducible. Each verified."""
    return [read_record(f) for f in _shipped_files()]


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
        if key in record_keys(r):
            return r
    return None


def record_keys(rec: dict) -> set[str]:
    """The calibration keys a record covers, in ``calibration_key``'s form."""
    return {_key_form(k) for k in rec.get("keys", ())}


def needs_record(cfg) -> bool:
    return (cfg.path.name not in DIFFICULTY_PATHS and cfg.model.prior and cfg.model.positional == "none"
            and cfg.task.name in ("assoc_recall", "markov", "linear_icl"))


# ------------------------------------------------------------------------------------ the store's clock
def _index(root: str | Path):
    """The index of the store at ``root`` (None where there is no store: nothing is created)."""
    if not (Path(root) / "index.sqlite").is_file():
        return None
    from ..store.index import RunIndex
    return RunIndex(Path(root), f"{socket.gethostname()}:{os.getpid()}")


def _row_config(row: dict):
    from ..config import RunConfig
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


def late_record_reason(run_id: str) -> str:
    return (f"prediction row {run_id} of its configuration was trained before the store first saw this record: "
            "a record added after the fact covers nothing; remove it (`softprior store verify --repair` moves it "
            "aside)")


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
    found = [(str(f), read_record(f), True) for f in _shipped_files()]
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


def verify_named(root: str | Path, hashes: Iterable[str | None]) -> dict[str, dict]:
    """For a report: the records its runs name (hash -> record; None and '' skipped), every record of
    the package and of the store at ``root`` verified on the way (``RecordRefused`` naming a file that
    does not verify); ``CalibrationMissing`` for a named hash that no valid record holds. Reads only."""
    held = {}
    for r in [*all_shipped_records(), *store_records(root)]:
        held.setdefault(r["hash"], r)
    out = {}
    for h in hashes:
        if not h:
            continue
        if h not in held:
            raise CalibrationMissing(f"calibration record {h}, named by a run, is held by neither the package nor "
                                     f"the store {str(root)!r}: its runs cannot count as calibrated")
        out[h] = held[h]
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
                f"the store saw before it started covers its task and initialisation; pre-register one with "
                f"`softprior calibrate {c.task.name} --register`, or train it as exploratory (--exploratory)")
    return covered


# ------------------------------------------------------------------------------------ git, the package's clock
_HEX16 = re.compile(r"\b[0-9a-f]{16}\b")
_PROVENANCE = re.compile(r"calibration record ([^;_\n]*)")


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=120)


def git_clock_problems(repo: str | Path, registered: str = "src/softprior/calibration/registered",
                       tables: str = "docs/results") -> list[str] | None:
    """One line per shipped record that is not older than the tables computed under it, naming the
    file; None where git or the repository's history is not available (not a checkout, a shallow clone).

    A table names its records in its provenance line ("calibration record HASH (n), ..."). For every
    commit that changed a table's mention of a record's hash, the record must already be in the
    commit's parent, under ``registered``, with the content it has now: a record added after its
    tables, or edited since (a v1 record's time is outside its hash), is refused. A hash a table names
    must be shipped."""
    repo = Path(repo)
    try:
        top = _git(repo, "rev-parse", "--show-toplevel", "--is-shallow-repository")
    except (OSError, subprocess.SubprocessError):
        return None
    lines = top.stdout.split()
    if top.returncode != 0 or len(lines) != 2 or lines[1] != "false" or Path(lines[0]).resolve() != repo.resolve():
        return None
    reg = repo / registered
    shipped = {}
    for f in sorted(reg.glob("*.json")):
        rec = json.loads(f.read_text())
        shipped[rec["hash"]] = (f"{registered}/{f.name}", rec)
    problems, named = [], {}
    for f in sorted((repo / tables).rglob("*.md")):
        for m in _PROVENANCE.finditer(f.read_text()):
            for h in _HEX16.findall(m.group(1)):
                named.setdefault(h, str(f.relative_to(repo)))
    for h, table in sorted(named.items()):
        if h not in shipped:
            problems.append(f"{table}: names calibration record {h}, which {registered}/ does not ship")
    for h, (rel, rec) in sorted(shipped.items()):
        log = _git(repo, "log", "--format=%H", "-S", h, "--", tables)
        for commit in log.stdout.split():
            parent = _git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^")
            if parent.returncode != 0 or not _shipped_at(repo, parent.stdout.strip(), registered, rec):
                problems.append(f"{rel}: calibration record {h} was added or edited after commit {commit[:12]}, "
                                f"whose tables under {tables}/ were computed under it")
                break
    return problems


def _shipped_at(repo: Path, commit: str, registered: str, rec: dict) -> bool:
    """Whether ``commit`` shipped a record equal to ``rec`` (any file of ``registered``)."""
    ls = _git(repo, "ls-tree", "--name-only", f"{commit}:{registered}")
    for name in ls.stdout.split() if ls.returncode == 0 else []:
        if name.endswith(".json"):
            shown = _git(repo, "show", f"{commit}:{registered}/{name}")
            try:
                if shown.returncode == 0 and json.loads(shown.stdout) == rec:
                    return True
            except ValueError:
                continue
    return False
