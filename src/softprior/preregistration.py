"""Calibration records, the core that every layer reads: what a record is, its hash and its
verification, the calibration key of a run config, and the records the package ships. A bottom-layer
module (it imports nothing of the package), so ``config`` builds a task's default run from its
shipped record without reaching up into ``calibration/``.

A record fixes the task design and initialisation *before* any prediction row of that configuration
is trained (docs/DESIGN.md, "Calibration"). It holds the chosen candidate's task and model options,
the criteria it was chosen by, what they measured, a UTC timestamp and a content hash. Records live
in the run store (``STORE/calibration/<task>-<hash>.json``: ``store.record_clock`` reads and writes them,
the store's clock included) and, for the package defaults, in the package
(``softprior/calibration/registered/<task>.json``, copied there by ``softprior calibrate --register``
with ``--ship``). ``config.make_run_config`` builds a task's default run from its shipped record.

A *prediction row* (any path other than the difficulty rows) of the soft-prior model needs a record
that covers its calibration key (task options and initialisation fields; not sizes, not training
settings, not Markov's p): ``needs_record``, ``calibration_key``; the store refuses to train one
that no record covers (``store.record_clock.check_calibrated``, ``CalibrationMissing``). Exploratory
runs pass ``require_calibration=False``.

Records prove themselves:

- **The hash.** ``record_hash`` recomputes a record's hash from the record itself, by the scheme it
  names (``hash_scheme``): v2 (what ``calibration.register.make_record`` writes) hashes everything but
  the hash, so its content, its calibration keys and its time ``registered_at``; v1 (records without
  ``hash_scheme``: every record written before v2, the shipped ones included) hashed everything but
  the hash and the time. Each record verifies under its own scheme, so old records and the runs made
  under them stay valid (the hash is no part of a run id). Every read of a record (``read_record``:
  training a prediction row, the summary's covering record, the package defaults, ``store verify``,
  and ``store.record_clock.verify_named`` for a report's runs) recomputes it; a mismatch (a forged or
  edited record) raises ``RecordRefused``, one line naming the file.
- **The store's clock** (``store.record_clock``): a record cannot vouch for its own time, so the store
  keeps one: its index notes when it first saw each record's hash (table ``record_sightings``,
  append-only), and every finished run the hash of the record it ran under (column ``runs.record``;
  '' for none). A run is covered only by a record the store saw before the run started (its row's
  ``created``): a record placed in ``STORE/calibration/`` after a prediction row of its configuration
  is refused, one line naming the file, and never covers a run that started before it. (Runs
  committed before the store kept its clock have ``record`` NULL and are not judged by it.)
- **Git, the clock of the shipped records.** ``git_clock_problems`` checks in the repository's
  history that every table under ``docs/results/`` naming a shipped record was committed after that
  record, with the content it has now. ``age_problems`` checks each shipped record's age against
  the rows it covers: in a git checkout, the first commit that shipped it with its present content
  (``first_commits``) must be no earlier than its ``registered_at`` and no later than the first
  prediction row it covers (the store's start times, or a results bundle's manifest); a record never
  committed with its present content (forged, or edited since) is refused. Outside git (an installed
  package, a shallow clone) ``registered_at`` is read against the first row alone, and a results
  bundle's manifest (``bundle.py``) carries the hashes and first-row times a report checks.
- **The claims.** A v2 record registers the claims' predicates (``claims.claims_spec``);
  ``claims.changed_claims`` compares them with today's declaration, and a verdict whose predicate
  changed since is refused (``claims.verdicts``), as ``store verify`` reports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import subprocess
from importlib import resources
from pathlib import Path
from typing import Iterable

__all__ = ["calibration_key", "shipped_records", "all_shipped_records", "find_record", "CalibrationMissing",
           "record_named", "use_record", "UnknownRecordError",
           "RecordRefused", "DIFFICULTY_PATHS", "LATER_DEFAULTS", "default_options", "record_hash", "verify_record",
           "read_record", "shipped_files", "late_record_reason", "needs_record", "record_keys", "git_clock_problems",
           "HASH_SCHEME", "WRITE_ONCE_MINUTES", "without_later_defaults", "first_commits", "age_problems", "package_repo", "registered_time", "REGISTERED"]

# identification rows' paths (tiers.py): a constant or learned gate, or no prior; they need no record
DIFFICULTY_PATHS = {"unforced", "forced_zero", "forced_const0.5", "soft_pos_only", "soft_content_only"}
_INIT_FIELDS = ("embed_init_std", "content_rank", "content_init_std", "gate_granularity", "gate_logit_init",
                "prior_init", "prior_layers", "prior_scale", "prior_cap", "pos_beyond", "prior_family", "prior_gain",
                "norm", "attn_scale")
_ROW_FIELDS = {"p"}  # task options that differ between the rows of one candidate

HASH_SCHEME = 2  # the scheme calibration.register.make_record writes
_UNHASHED = {1: ("hash", "registered_at"), 2: ("hash",)}  # per scheme: the fields its hash leaves out


# options added after the first release (task design and initialisation axes of the calibration
# search): hashed only when set away from their default, so every earlier run id stays valid
# (``config.RunConfig.canonical``) and a record written before an option existed still covers the
# configurations it covered then (``calibration_key``)
LATER_DEFAULTS = {
    "task": {"layout": "disjoint", "n_queries": 1, "loss_on": ("last", "final"), "placement": "packed",
             "query": "distinct", "n_points": None, "keys": "distinct", "repeat_target": "uniform",
             "answer": "successor", "format": "interleaved", "w_scale": "unit", "noise": 0.0},
    "model": {"prior_cap": 8.0, "pos_beyond": "clip", "prior_family": "soft", "prior_gain": 1.0, "norm": "pre",
              "attn_scale": "inverse_sqrt"},
}


def without_later_defaults(options: dict, defaults: dict) -> dict:
    """``options`` less the entries at their later default (``defaults``: one part of ``LATER_DEFAULTS``;
    a tuple there lists every value that counts as the default): what a run id (``config.RunConfig.canonical``)
    and a calibration key (``calibration_key``) hash, so neither moves when an option is added."""
    return {k: v for k, v in options.items()
            if not (k in defaults and (v in defaults[k] if isinstance(defaults[k], tuple) else v == defaults[k]))}


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
    less the options added later at their defaults (``LATER_DEFAULTS``, as for run ids), so a
    record written before an option existed still covers the configurations it covered then."""
    t = {k: v for k, v in cfg.task.model_dump(mode="json").items() if k not in _ROW_FIELDS}
    m = cfg.model.model_dump(mode="json")
    return _key_form({"task": t, "init": {k: m[k] for k in _INIT_FIELDS}})


def _key_form(key) -> str:
    """A calibration key (a dict or its JSON) without the later options at their defaults."""
    d = json.loads(key) if isinstance(key, str) else key
    for part, defaults in (("task", LATER_DEFAULTS["task"]), ("init", LATER_DEFAULTS["model"])):
        d = {**d, part: without_later_defaults(d.get(part, {}), defaults)}
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


def shipped_files():
    """The package's record files (``registered/*.json``)."""
    return _shipped_files()


def _shipped_files():
    root = resources.files("softprior") / "calibration" / "registered"  # data: imports no calibration code
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
    """Every record the package ships: the defaults (``TASK.json``) and superseded ones (any other
    ``*-TASK.json``: legacy-, distinct-, successor-, interleaved-), which stay registered so that the
    runs made under them remain reproducible. Each verified."""
    return [read_record(f) for f in _shipped_files()]


_IN_USE: dict[str, dict] = {}  # task -> the record ``use_record`` makes its default, while it is active


def record_named(name: str) -> dict:
    """The shipped record whose file is ``registered/NAME.json`` (a default, ``assoc_recall``, or a
    superseded or further one, ``identified-assoc_recall``), verified; ``UnknownRecordError`` names the
    shipped ones."""
    for f in _shipped_files():
        if Path(str(f)).stem == name:
            return read_record(f)
    raise UnknownRecordError(f"unknown record {name!r}; shipped: "
                             + ", ".join(Path(str(f)).stem for f in _shipped_files()))


class UnknownRecordError(ValueError):
    pass


@contextlib.contextmanager
def use_record(name: str | None):
    """Within: the shipped record ``name`` (``record_named``) is its task's default configuration
    (``default_options``), so the paper's cells of that task are built on it (``experiments.Options.record``:
    the paper's tables on another pre-registered configuration). ``None``: the shipped defaults."""
    if name is None:
        yield None
        return
    rec = record_named(name)
    before = _IN_USE.get(rec["task"])
    _IN_USE[rec["task"]] = rec
    try:
        yield rec
    finally:
        if before is None:
            _IN_USE.pop(rec["task"], None)
        else:
            _IN_USE[rec["task"]] = before


def default_options(task: str) -> tuple[dict, dict]:
    """(task_options, model_options) of a task's shipped pre-registered default (empty if none), or of
    the record ``use_record`` puts in its place."""
    rec = _IN_USE.get(task) or shipped_records().get(task)
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
    """Whether ``cfg`` is a prediction row of the soft-prior model (any prior family): a path other
    than the difficulty rows, with the prior on and no static scheme. Of every registered task: a run
    config's task is validated by the task registry (``tasks.registry.TASK_SPECS``), so a task a plugin
    registers needs a record as the paper's three do (this module imports nothing of the package, so
    it does not name the tasks, nor asks the registry again)."""
    return cfg.path.name not in DIFFICULTY_PATHS and cfg.model.prior and cfg.model.positional == "none"


def late_record_reason(run_id: str) -> str:
    return (f"prediction row {run_id} of its configuration was trained before the store first saw this record: "
            "a record added after the fact covers nothing; remove it (`softprior store verify --repair` moves it "
            "aside)")


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


# ------------------------------------------------------------------------------------ a record's age
REGISTERED = "src/softprior/calibration/registered"  # the shipped records, relative to the repository


def package_repo() -> Path | None:
    """The git checkout this package is imported from (``src/softprior`` two levels below its root), or
    None (an installed package, no git, a shallow clone: there the bundle's manifest is the clock)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists() or not (root / REGISTERED).is_dir():
        return None
    try:
        top = _git(root, "rev-parse", "--show-toplevel", "--is-shallow-repository")
    except (OSError, subprocess.SubprocessError):
        return None
    lines = top.stdout.split()
    if top.returncode != 0 or len(lines) != 2 or lines[1] != "false" or Path(lines[0]).resolve() != root:
        return None
    return root


def registered_time(rec: dict) -> float | None:
    """A record's ``registered_at`` (UTC, "YYYY-MM-DDTHH:MM:SSZ") as a Unix time; None if absent or unreadable."""
    import calendar
    import time
    try:
        return float(calendar.timegm(time.strptime(rec["registered_at"], "%Y-%m-%dT%H:%M:%SZ")))
    except (KeyError, TypeError, ValueError):
        return None


# Write-once: a shipped record (hash scheme 2) is committed within this many minutes of its
# ``registered_at`` (registration prints the command: ``reports.calibration_doc.ship_record``), and its content
# never changes after: a rewritten record, re-hashed with its old time kept, is first committed with its
# new content long after that time, and is refused at train, report and ``store verify``. v1 records
# (the first release's, whose time is outside their hash) are judged by the other rules alone.
WRITE_ONCE_MINUTES = 15

_COMMITS: dict[tuple, dict] = {}  # (repo, HEAD, the records' texts) -> first_commits' answer


def first_commits(repo: str | Path, registered: str = REGISTERED) -> dict[str, tuple[str, float] | None]:
    """Shipped record file (relative to ``repo``) -> (commit, commit time) of the first commit in which a
    file of ``registered`` held that record with its present content, or None where none did (a record
    added or edited since its last commit, or never committed). Read from git (``git log -S HASH``: the
    commits that changed how often its hash appears there), cached per HEAD and content."""
    repo = Path(repo)
    files = sorted((repo / registered).glob("*.json"))
    texts = tuple(f.read_text() for f in files)
    head = _git(repo, "rev-parse", "HEAD").stdout.strip()
    key = (str(repo), head, texts)
    if key not in _COMMITS:
        out = {}
        for f, text in zip(files, texts):
            rel = f"{registered}/{f.name}"
            try:
                rec = json.loads(text)
                h = rec["hash"]
            except (ValueError, KeyError, TypeError):
                out[rel] = None
                continue
            log = _git(repo, "log", "--reverse", "--format=%H %ct", "-S", str(h), "--", registered).stdout.split("\n")
            out[rel] = next(((c, float(t)) for c, t in (line.split() for line in log if line.strip())
                             if _shipped_at(repo, c, registered, rec)), None)
        _COMMITS.clear()
        _COMMITS[key] = out
    return dict(_COMMITS[key])


def age_problems(first_rows: dict[str, float | None], records: Iterable[tuple[str, dict]] | None = None,
                 repo: str | Path | None = None) -> list[tuple[str, str]]:
    """(file, why) per record that does not prove its age (``RecordRefused(file, why)`` says it in one line). ``first_rows``: record hash ->
    the start time of the first prediction row it covers (None: no row yet, e.g. at train time the rows
    start now), for the records to judge; ``records``: (file, record) pairs (default: the shipped
    ones); ``repo``: the checkout (default ``package_repo()``; outside git only ``registered_at`` is read).
    A shipped record in a checkout must have been committed with its present content (``first_commits``),
    no earlier than its ``registered_at`` and no later than its first row; any record's
    ``registered_at`` must be no later than its first row."""
    import time
    repo = package_repo() if repo is None else Path(repo)
    if records is None:
        records = [(f"{REGISTERED}/{Path(str(f)).name}", read_record(f)) for f in _shipped_files()]
    commits = first_commits(repo) if repo is not None else {}
    out = []

    def when(t: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    for where, rec in records:
        h = rec.get("hash")
        if h not in first_rows:
            continue
        row, reg = first_rows[h], registered_time(rec)
        if reg is None:
            out.append((where, f"no readable registered_at ({rec.get('registered_at')!r})"))
            continue
        if row is not None and reg > row:
            out.append((where, f"registered_at {rec['registered_at']} is later than the first prediction row it "
                               f"covers (started {when(row)}): it was registered after the fact"))
            continue
        if repo is None or where not in commits:
            continue
        first = commits[where]
        if first is None:
            out.append((where, "no commit ships it with its present content: it was added or edited since (a "
                               "forged or rewritten record); commit a newly registered record before training under it"))
        elif first[1] < reg:
            out.append((where, f"first committed {when(first[1])} (commit {first[0][:12]}), before its registered_at "
                               f"{rec['registered_at']}: its time was rewritten"))
        elif row is not None and first[1] > row:
            out.append((where, f"first committed {when(first[1])} (commit {first[0][:12]}), after the first prediction "
                               f"row it covers started ({when(row)}): it was back-dated"))
        elif rec.get("hash_scheme", 1) >= 2 and first[1] > reg + 60 * WRITE_ONCE_MINUTES:
            out.append((where, f"first committed with its present content {when(first[1])} (commit {first[0][:12]}), "
                               f"{(first[1] - reg) / 60:.0f} minutes after its registered_at {rec['registered_at']}: "
                               f"a record is committed when it is registered (within {WRITE_ONCE_MINUTES} minutes) and "
                               "never rewritten; this one was written or rewritten later"))
    return out


def record_reading(record: str | None) -> str | None:
    """The length reading a shipped record registered (``length_reading``), where it is not "clip"; None
    for no record, an unknown one, or the clipped reading."""
    if record is None:
        return None
    try:
        chosen = record_named(record).get("length_reading", {}).get("chosen")
    except UnknownRecordError:
        return None
    return None if chosen in (None, "clip") else chosen
