"""``softprior store verify [--repair]``: check a run store against what was written.

When a run finishes, ``RunStore.save_result`` records the SHA-256 and size of every file it wrote
(config.json, metrics.jsonl, final.safetensors, summary.json, snapshots/step_N.safetensors) in the
index's ``files`` table, in the same transaction that marks the run done. ``verify_store`` then finds:

- a damaged index: ``PRAGMA integrity_check`` fails or the file is not a database (file
  ``index.sqlite``), or one finished run's row is unreadable (summary or config not JSON, a config
  whose hash is not its run id, checksums missing for its files): reported with that run id;
- a damaged run file: missing (a half-written or partly deleted run directory), truncated, or with
  other contents than were written (SHA-256 mismatch): reported with the run id and the file;
- finished runs of stores written before checksums existed: checked for readability only (every
  file present and parseable), and listed as such;
- a snapshot on disk without a checksum row (the row lost, or the file written after the run was
  committed): reported with the run id and the file, readable or not (it cannot be verified, and
  ``load_snapshots`` would read it);
- a finished run whose stored config (its index row, or config.json) does not hash to its run id once
  this code validates it: the run id would name other numbers than the ones stored;
- calibration records (``softprior/preregistration.py``, ``store/record_clock.py``): every record of the store (``STORE/calibration``)
  and of the package is re-hashed, a forged or edited one reported with its file; by the store's
  clock (its index's ``record_sightings`` and ``runs.record``), a store record first seen after a
  prediction row it covers had started (added after the fact), and a finished run that ran under a
  record the store does not hold, first saw only after the run started, or whose keys do not cover it;
  each record's age (``preregistration.age_problems``: ``registered_at`` no later than the first prediction row
  it covers and, for a shipped record in a git checkout, its first commit with its present content
  between the two); and a record whose registered claims differ from today's declaration
  (``claims.changed_claims``: listed as changed claims, whose verdicts the reports refuse; not damage
  that ``--repair`` moves).

Run directories without a finished run in the index (a run in progress, a failed run, or one killed
before it was committed) are listed as unfinished, not as damage: a sweep trains them anyway.

``repair=True`` re-queues only the damaged runs: their records are deleted from the index (so the
next ``softprior reproduce`` / ``train`` trains them again) and their directories are moved to
``STORE/damaged/RUN_ID.TIMESTAMP`` (nothing is deleted). A damaged index is moved aside to
``index.sqlite.damaged.TIMESTAMP`` and rebuilt from the run directories: every run whose files are
intact (against the checksums that could still be read from the old index, else for readability) is
indexed as done again, with its checksums; failed-run rows and recorded engine errors of the old index
are not carried over (they are kept in the moved file). The record sightings that can still be read
are carried over with their times, and the valid records present are seen at the rebuild, before the
runs are indexed again (a rebuilt index dates its runs from the rebuild); so are the time ledger's rows
that can still be read, in their order, with their times. Refused records of the store
are moved to ``STORE/damaged/calibration/NAME.TIMESTAMP``. Repair while no sweep writes to the store.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import preregistration as R
from ..claims import changed_claims
from ..config import RunConfig, config_hash
from . import RunStore
from .errors import StoreNotFoundError, StoreReadOnlyError
from .files import sha256_file
from .index import connect_read_only
from .record_clock import first_rows, record_files, rows_started_before

__all__ = ["verify_store", "VerifyReport", "Problem", "REQUIRED_FILES"]

REQUIRED_FILES = ("config.json", "metrics.jsonl", "final.safetensors", "summary.json")


@dataclass
class Problem:
    run_id: str | None  # None: the index as a whole
    file: str  # relative to the store root
    what: str

    def line(self) -> str:
        who = f"run {self.run_id}" if self.run_id else ("index" if self.file.startswith("index.sqlite") else "record")
        return f"DAMAGED {who}: {self.file}: {self.what}"


@dataclass
class VerifyReport:
    root: Path
    runs: int = 0  # finished runs checked
    files: int = 0  # files compared against a recorded checksum
    problems: list[Problem] = field(default_factory=list)
    index_damaged: bool = False
    unverified: list[str] = field(default_factory=list)  # finished runs with no recorded checksums
    unfinished: list[str] = field(default_factory=list)  # run directories without a finished run
    requeued: list[str] = field(default_factory=list)  # damaged runs whose records --repair deleted
    records: int = 0  # calibration records re-hashed (the store's and the package's)
    records_moved: list[str] = field(default_factory=list)  # refused store records --repair moved aside
    rebuilt: int | None = None  # runs indexed again after an index rebuild
    read_only: bool = False  # the store's directory cannot be written (verified all the same; no --repair)
    claims_changed: list[str] = field(default_factory=list)  # "FILE: claim: change" (claims.changed_claims)
    # the same for the package's shipped records: the package's declaration moved after they registered it.
    # Reported (their verdicts are refused in every table), but nothing in the store is wrong: not unhealthy
    shipped_claims_changed: list[str] = field(default_factory=list)

    @property
    def damaged_runs(self) -> list[str]:
        return sorted({p.run_id for p in self.problems if p.run_id})

    @property
    def refused_records(self) -> list[str]:
        """The record files refused (forged, edited, or added after the fact)."""
        return sorted({p.file for p in self.problems if p.run_id is None and not p.file.startswith("index.sqlite")})

    @property
    def healthy(self) -> bool:
        return not self.problems and not self.claims_changed

    def lines(self) -> list[str]:
        where = f"store {str(self.root)!r}"
        ro = " (read-only: checked without writing)" if self.read_only else ""
        if self.healthy:
            out = [f"{where} is healthy{ro}: {self.runs} finished runs, {self.files} files match the SHA-256 "
                   "checksums recorded when they were written"]
        else:
            out = [p.line() for p in self.problems]
            out += [f"CHANGED CLAIM {c} (its verdict is refused until it is registered again)" for c in self.claims_changed]
            bad = self.damaged_runs
            repaired = bool(self.requeued) or self.rebuilt is not None
            fix = ("; the store is read-only: copy it somewhere writable, then `softprior store verify --repair` "
                   "there ") if self.read_only else "; `softprior store verify --repair` "
            if self.index_damaged:
                out.append(f"{where}: the index is damaged" + (f", and {len(bad)} run(s): {', '.join(bad)}" if bad else "")
                           + ("" if repaired else fix + "rebuilds it from the run directories, keeping every intact "
                              "run and re-queueing damaged ones"))
            elif bad or (self.problems and not self.refused_records):
                out.append(f"{where}: {len(bad)} damaged run(s) ({', '.join(bad)}); the other {self.runs - len(bad)} "
                           "finished runs are intact" + ("" if repaired else fix + "re-queues only the damaged runs"))
        if self.shipped_claims_changed:  # one line: the package's matter, not the store's
            names = sorted({c.split(": ")[1] for c in self.shipped_claims_changed})
            files = sorted({c.split(": ")[0].rsplit("/", 1)[-1] for c in self.shipped_claims_changed})
            out.append(f"note: the package's declaration changed {len(names)} claim(s) since its shipped records "
                       f"registered them ({', '.join(names)}; records {', '.join(files)}): those verdicts on those "
                       "records are refused in every table; the store is not affected")
        if self.refused_records:
            out.append(f"{where}: {len(self.refused_records)} calibration record(s) refused "
                       f"({', '.join(self.refused_records)})" + ("" if self.records_moved or self.rebuilt is not None
                                                                else "; `softprior store verify --repair` moves the "
                                                                "store's aside to damaged/calibration/"))
        return out + self._notes()

    def _notes(self) -> list[str]:
        """The lines after the problems: what was read without checksums or left unfinished, and the repairs."""
        def listed(items, what):
            return f"{len(items)} {what} ({', '.join(items)})"
        rows = [(self.unverified, lambda: f"note: {len(self.unverified)} finished run(s) have no recorded checksums "
                 "(written before checksums were recorded): checked for readability only"),
                (self.unfinished, lambda: f"note: {listed(self.unfinished, 'run director(y/ies) without a finished run')}:"
                 " in progress, failed or never committed; a sweep trains them"),
                (self.rebuilt is not None, lambda: f"repaired: index rebuilt from the run directories ({self.rebuilt} "
                 "finished runs indexed; the damaged index was kept as index.sqlite.damaged.*)"),
                (self.requeued, lambda: f"repaired: re-queued {listed(self.requeued, 'damaged run(s)')}: records "
                 "deleted, files moved to damaged/; the next reproduce or train retrains them"),
                (self.records_moved, lambda: f"repaired: moved {listed(self.records_moved, 'refused calibration record(s)')}"
                 " to damaged/calibration/")]
        return [line() for applies, line in rows if applies]


# ------------------------------------------------------------------------------------ reading the index
def _read_index(path: Path):
    """(rows of finished runs {run_id: row}, checksums {run_id: {name: (sha, size)}}, all run ids, error).
    Only reads; whatever could be read is returned even when ``error`` is set."""
    done, sums, ids, error = {}, {}, set(), None
    try:  # never writes, read-only store or not (a read-only store is not a damaged one)
        db = connect_read_only(path)
    except sqlite3.Error as e:
        return done, sums, ids, f"cannot be opened ({e})"
    try:
        db.row_factory = sqlite3.Row
        try:
            check = [r[0] for r in db.execute("PRAGMA integrity_check").fetchall()]
            if check != ["ok"]:
                error = "integrity check failed: " + "; ".join(check[:3])
        except sqlite3.DatabaseError as e:
            return done, sums, ids, str(e)
        try:
            for r in db.execute("SELECT * FROM runs"):  # (with created and record: the store's clock)
                ids.add(r["run_id"])
                if r["status"] == "done":
                    done[r["run_id"]] = dict(r)
            for r in db.execute("SELECT run_id, name, sha256, size FROM files"):
                sums.setdefault(r["run_id"], {})[r["name"]] = (r["sha256"], r["size"])
        except sqlite3.DatabaseError as e:
            error = error or str(e)
    finally:
        db.close()
    return done, sums, ids, error


def _read_rows(path: Path, sql: str) -> list[sqlite3.Row]:
    """The rows of a read-only query on the index at ``path``; empty where they cannot be read (a
    store from before the table, a damaged index)."""
    try:
        db = connect_read_only(path)
    except sqlite3.Error:
        return []
    try:
        db.row_factory = sqlite3.Row
        return db.execute(sql).fetchall()
    except sqlite3.DatabaseError:
        return []
    finally:
        db.close()


def _read_clock(path: Path) -> dict[str, float]:
    """The index's record sightings (hash -> first seen), as far as they can be read."""
    return {r["hash"]: r["first_seen"] for r in _read_rows(path, "SELECT hash, first_seen FROM record_sightings")}


def _read_ledger(path: Path) -> list[dict]:
    """The index's time-ledger rows, oldest first (``RunIndex.ledger``'s columns), as far as they can be read."""
    return [dict(r) for r in _read_rows(path, "SELECT * FROM ledger ORDER BY id")]


def _row_problem(rid: str, row: dict) -> str | None:
    """Why a finished run's index row is unusable, or None."""
    try:
        cfg = json.loads(row["config"])
        if config_hash(cfg) != rid:
            return "index row damaged: its config does not hash to the run id"
    except (TypeError, ValueError):
        return "index row damaged: config is not JSON"
    try:
        again = RunConfig.model_validate(cfg).run_id
    except ValueError as e:
        return f"its config is not a valid run config for this code ({' '.join(str(e).split())[:120]})"
    if again != rid:
        return (f"its config, validated by this code, hashes to {again}, not to its run id: the run id would name "
                "other numbers than the ones stored")
    try:
        if not isinstance(json.loads(row["summary"]), dict):
            raise ValueError
    except (TypeError, ValueError):
        return "index row damaged: summary is not a JSON object"
    return None


# ------------------------------------------------------------------------------------ checking run files
def _readable(path: Path) -> str | None:
    """Why a run file cannot be read, or None (the check for runs without recorded checksums)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            load_file(str(path))
        elif path.name == "metrics.jsonl":
            for line in path.read_text().splitlines():
                if line.strip():
                    json.loads(line)
        elif path.name == "config.json":
            if RunConfig.model_validate_json(path.read_text()).run_id != path.parent.name:
                return "unreadable: its config does not hash to the run id"
        else:
            json.loads(path.read_text())
    except Exception as e:  # noqa: BLE001 - any failure to parse is damage
        return f"unreadable ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
    return None


def _run_file_names(d: Path) -> list[str]:
    """The files a finished run directory holds: the required ones and its snapshots."""
    return list(REQUIRED_FILES) + sorted(f"snapshots/{p.name}" for p in (d / "snapshots").glob("step_*.safetensors"))


def _check_files(root: Path, rid: str, recorded: dict | None, report: VerifyReport) -> list[Problem]:
    d = root / "runs" / rid
    rel = f"runs/{rid}"
    if not d.is_dir():
        return [Problem(rid, rel, "run directory missing")]
    out = []
    if recorded:
        for name in REQUIRED_FILES:
            if name not in recorded:
                out.append(Problem(rid, "index.sqlite", f"index row damaged: no checksum recorded for {name}"))
        for name, (sha, size) in sorted(recorded.items()):
            f = d / name
            if not f.is_file():
                out.append(Problem(rid, f"{rel}/{name}", "missing (half-written or partly deleted run directory)"))
                continue
            got_sha, got_size = sha256_file(f)
            report.files += 1
            if got_size < size:
                out.append(Problem(rid, f"{rel}/{name}", f"truncated ({got_size:,} of {size:,} bytes)"))
            elif got_size != size:
                out.append(Problem(rid, f"{rel}/{name}", f"size changed ({got_size:,} bytes, {size:,} written)"))
            elif got_sha != sha:
                out.append(Problem(rid, f"{rel}/{name}", "contents changed since written (SHA-256 mismatch)"))
        for name in _run_file_names(d):  # a snapshot nothing vouches for
            if name not in recorded and name.startswith("snapshots/"):
                why = _readable(d / name)
                out.append(Problem(rid, f"{rel}/{name}", "no checksum recorded for it (the row lost, or the file "
                                   "written after the run was committed)" + (f"; {why}" if why else "")))
        if "config.json" in recorded and (d / "config.json").is_file() and not any(
                p.file == f"{rel}/config.json" for p in out):  # the stored config re-hashed to the run id
            if (why := _readable(d / "config.json")) is not None:
                out.append(Problem(rid, f"{rel}/config.json", why))
        return out
    names = _run_file_names(d)
    for name in names:
        f = d / name
        if not f.is_file():
            out.append(Problem(rid, f"{rel}/{name}", "missing (half-written or partly deleted run directory)"))
        elif (why := _readable(f)) is not None:
            out.append(Problem(rid, f"{rel}/{name}", why))
    return out


# ------------------------------------------------------------------------------------ verify / repair
def verify_store(root: str | os.PathLike, repair: bool = False) -> VerifyReport:
    """Check every finished run of the store at ``root`` (see the module docstring); with ``repair``
    re-queue the damaged runs and rebuild a damaged index. Never creates a store."""
    root = Path(root)
    index = root / "index.sqlite"
    if not index.is_file():
        raise StoreNotFoundError(f"no run store at {str(root)!r} (no index.sqlite there); check --store")
    read_only = not os.access(root, os.W_OK)
    if repair and read_only:
        raise StoreReadOnlyError(f"store {str(root)!r} is read-only (its directory cannot be written): --repair "
                                 "needs write access; `softprior store verify` without --repair checks it, or copy "
                                 "the store somewhere writable and repair the copy")
    done, sums, ids, error = _read_index(index)
    report = VerifyReport(root, read_only=read_only)
    if error:
        report.index_damaged = True
        report.problems.append(Problem(None, "index.sqlite", f"the index is damaged: {error}"))
    for rid, row in sorted(done.items()):
        report.runs += 1
        why = _row_problem(rid, row)
        if why:
            report.problems.append(Problem(rid, "index.sqlite", why))
        recorded = sums.get(rid)
        if not recorded:
            report.unverified.append(rid)
        report.problems += _check_files(root, rid, recorded, report)
    clock, ledger = _read_clock(index), _read_ledger(index)
    if not report.index_damaged:
        report.problems += _record_problems(root, done, clock, report)
    if not report.index_damaged:  # (with a damaged index every directory would look unfinished)
        run_dirs = sorted(p.name for p in (root / "runs").iterdir() if p.is_dir()) if (root / "runs").is_dir() else []
        report.unfinished = [r for r in run_dirs if r not in done]
    if not repair or report.healthy:
        return report
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if report.index_damaged:
        report.requeued, report.rebuilt = _rebuild_index(root, sums, stamp, sightings=clock, ledger=ledger)
        report.records_moved = _move_records_aside(root, report, stamp)
        return report
    bad = report.damaged_runs
    RunStore(root, read_only=False).forget(bad)
    for rid in bad:
        _move_aside(root, rid, stamp)
    report.requeued = bad
    report.records_moved = _move_records_aside(root, report, stamp)
    return report


def _move_aside(root: Path, rid: str, stamp: str) -> None:
    d = root / "runs" / rid
    if d.is_dir():
        (root / "damaged").mkdir(exist_ok=True)
        shutil.move(str(d), str(root / "damaged" / f"{rid}.{stamp}"))


def _rebuild_index(root: Path, salvaged: dict, stamp: str, sightings: dict | None = None,
                   ledger: list[dict] | None = None) -> tuple[list[str], int]:
    """Move the damaged index aside, then index every intact finished run directory again (after the
    record sightings: those salvaged, with their times, and the valid records present, now; and the
    time-ledger rows salvaged, as they were)."""
    for suffix in ("", "-wal", "-shm"):
        f = root / f"index.sqlite{suffix}"
        if f.exists():
            os.replace(f, root / f"index.sqlite.damaged.{stamp}{suffix}")
    store = RunStore(root, read_only=False)  # a fresh, empty index
    _restore_clock(store.index, root, sightings or {})
    for r in ledger or []:
        try:
            detail = json.loads(r.get("detail") or "{}")
            store.index.record_timing(r["kind"], r["name"], r["seconds"], r["flop"], r["runs"], r["started_at"],
                                      r["host"], r["code_version"], r["gemm_gflops"], detail, created=r["created"])
        except (KeyError, TypeError, ValueError):  # a row the damage reached: left in the moved file
            continue
    requeued, indexed = [], 0
    scratch = VerifyReport(root)
    for d in sorted(p for p in (root / "runs").iterdir() if p.is_dir()):
        rid = d.name
        if not (d / "summary.json").is_file():
            continue  # never finished (summary.json is written last): a sweep trains it anyway
        # against the checksums still readable from the damaged index, else for readability (checksum
        # rows lost with the index are the index's damage, not the run's: the files are read instead)
        recorded = salvaged.get(rid)
        if recorded and not all(n in recorded for n in _run_file_names(d)):
            recorded = None
        if _check_files(root, rid, recorded, scratch):
            requeued.append(rid)
            _move_aside(root, rid, stamp)
            continue
        cfg = RunConfig.model_validate_json((d / "config.json").read_text())
        summary = json.loads((d / "summary.json").read_text())
        names = _run_file_names(d)
        store.index.commit_done(cfg, summary, {n: sha256_file(d / n) for n in names})
        indexed += 1
    return requeued, indexed


# ------------------------------------------------------------------------------------ calibration records
def _record_problems(root: Path, done: dict, clock: dict[str, float], report: VerifyReport) -> list[Problem]:
    """Every record re-hashed (the store's and the package's), and the store's clock: a store record
    first seen after a prediction row it covers had started; a finished run that ran under a record the
    store does not hold (valid), saw only after the run started, or whose keys do not cover it."""
    out, valid, dated = [], {}, []
    files = [(f, f"{R.REGISTERED}/{Path(str(f)).name}", False) for f in R.shipped_files()]
    files += [(p, str(p.relative_to(root)), True) for p in record_files(root)]
    for f, rel, in_store in files:
        report.records += 1
        try:
            rec = R.read_record(f)
        except R.RecordRefused as e:
            out.append(Problem(None, rel, f"calibration record refused: {e.why}"))
            continue
        valid.setdefault(rec["hash"], rec)
        dated.append((rel, rec))
        (report.claims_changed if in_store else report.shipped_claims_changed).extend(
            f"{rel}: {name}: {line}" for name, lines in changed_claims(rec.get("claims", [])).items() for line in lines)
        if in_store:
            early = rows_started_before(done.values(), rec, clock.get(rec["hash"]))
            if early:
                out.append(Problem(None, rel, f"calibration record refused: {R.late_record_reason(early[0])}"))
    first = first_rows(done.values())
    for rel, why in R.age_problems({r["hash"]: first.get(r["hash"]) for _, r in dated}, dated):
        out.append(Problem(None, rel, f"calibration record refused: {why}"))
    for rid, row in sorted(done.items()):
        h = row.get("record")
        if not h:  # '': trained under no record (exploratory, or not a prediction row); NULL: before the clock
            continue
        rec = valid.get(h)
        if rec is None:
            out.append(Problem(rid, "index.sqlite", f"ran under calibration record {h}, which neither the store nor "
                                                    "the package holds (as a record whose hash verifies)"))
            continue
        try:
            named = json.loads(row["summary"]).get("calibration")
            cfg = RunConfig.model_validate(json.loads(row["config"]))
        except (TypeError, ValueError, AttributeError):
            continue  # an unreadable row: _row_problem reports it
        if named != h:
            out.append(Problem(rid, "index.sqlite", f"its summary names calibration record {named}, its index row {h}"))
        if R.needs_record(cfg):
            seen = clock.get(h)
            if R.calibration_key(cfg) not in R.record_keys(rec):
                out.append(Problem(rid, "index.sqlite", f"ran under calibration record {h}, which does not cover "
                                                        "its configuration"))
            elif seen is None or seen > (row.get("created") or 0.0):
                out.append(Problem(rid, "index.sqlite", f"ran under calibration record {h}, which the store first saw "
                                                        "after the run started"
                                   + (" (never)" if seen is None else "")))
    return out


def _move_records_aside(root: Path, report: VerifyReport, stamp: str) -> list[str]:
    """Move the refused records of the store to ``STORE/damaged/calibration/NAME.TIMESTAMP``."""
    moved = []
    for rel in report.refused_records:
        f = root / rel
        if rel.startswith("calibration/") and f.is_file():
            (root / "damaged" / "calibration").mkdir(parents=True, exist_ok=True)
            shutil.move(str(f), str(root / "damaged" / "calibration" / f"{f.name}.{stamp}"))
            moved.append(rel)
    return moved


def _restore_clock(index, root: Path, sightings: dict[str, float]) -> None:
    """A rebuilt index's record sightings: those read from the damaged one, with their times, then every
    valid record present (seen now, before the runs are indexed again)."""
    for h, t in sorted(sightings.items(), key=lambda x: x[1]):
        index.see_records({h: "carried over from the damaged index"}, when=t)
    now = {}
    for f in [*R.shipped_files(), *record_files(root)]:
        try:
            now[R.read_record(f)["hash"]] = str(f)
        except R.RecordRefused:
            continue  # reported by the verification after the repair
    if now:
        index.see_records(now)
