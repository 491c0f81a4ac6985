"""The results bundle: everything the reports read, as small files, so the documents regenerate without
the run store (docs/DESIGN.md, "The results bundle").

A report reads a *source*: a run store, or a bundle, which answers the same questions from files.
The questions are the store's own (``is_done``, ``summary``, ``metrics``) and *derived* ones, whose
answer a store computes from weights or from a costly analysis: a run evaluated under a gate override
or at another length, a task's ceiling, a mechanism or continuation trace, a circuit, the calibration
search's candidates. A report asks those through ``ask`` / ``ask_many`` with a kind, a key (JSON) and
the computation: a store computes, a ``Recorder`` (a store seen through the bundle being written)
computes, writes the answer into the bundle and hands the report what the bundle will give back, and a
``BundleSource`` answers from the files and never computes. So one report function writes a document
from either, and the text is the same byte for byte.

Layout (``FORMAT`` 1; ``BundleSource`` refuses any other)::

    bundle/manifest.json          format, the writer's code version, the options the cells were built
                                  with, the experiments and calibration spaces in order, exploratory or
                                  not, where the documents were written (relative to the results), and
                                  ``records``: each record's hash -> the start time of the first
                                  prediction row the store trained under it (``first_row``, Unix
                                  seconds; null: none), the clock a report checks a record's age by
                                  outside git (``preregistration.age_problems``)
    bundle/parts/NAME.json        per experiment (and ``calibration-SPACE``): every run it asked about
                                  (done or not), its derived answers (kind, key, value), its frames
    bundle/summaries/RUN_ID.json  a finished run's summary (no weights)
    bundle/curves/RUN_ID.json     its metrics curve (columns, rows), where a report read it
    bundle/frames/KIND/HASH.csv   a derived table (a mechanism or continuation trace), round-trip floats
    bundle/records/HASH.json      the calibration records the runs name, verified when read
    bundle/ledger.json            the store's time ledger (``RunStore.ledger``: every row, oldest first) and
                                  each job's kind (task/size and positional scheme), read by
                                  ``softprior report timings --from-bundle``

Nothing here imports the reports or the calibration package (a layer below both).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path

from .store.errors import StoreError

__all__ = ["FORMAT", "BundleError", "BundleSource", "BundleWriter", "Recorder", "add_part", "ask", "ask_many",
           "find_bundle", "read_ledger", "write_ledger"]

FORMAT = 1
MANIFEST = "manifest.json"
LEDGER = "ledger.json"


class BundleError(StoreError):
    """A bundle that cannot answer: absent, of another format, or asked a question it holds no answer to."""


def ask(source, kind: str, key: dict, compute, *, frame: bool = False, encode=None, decode=None):
    """One derived answer of ``source`` (module docstring): ``compute()`` for a store, recorded by a
    ``Recorder``, read by a ``BundleSource``. ``frame``: the answer is a DataFrame (a CSV file);
    otherwise JSON, ``encode`` / ``decode`` converting a value that JSON does not hold as it is."""
    return ask_many(source, kind, [key], lambda: [compute()], frame=frame, encode=encode, decode=decode)[0]


def ask_many(source, kind: str, keys: list[dict], compute, *, frame: bool = False, encode=None, decode=None) -> list:
    """``ask`` for several keys whose answers are computed together (``compute()`` returns them in order)."""
    derived = getattr(source, "derived", None)
    if derived is None:
        return list(compute())
    return derived(kind, keys, compute, frame=frame, encode=encode, decode=decode)


# ---------------------------------------------------------------------------------------- files
def _canon(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _digest(kind: str, key) -> str:
    return hashlib.sha256(f"{kind}\n{_canon(key)}".encode()).hexdigest()[:16]


def _replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary name (two report workers may write the same run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _dump(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True, allow_nan=True) + "\n"


def _compact(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)


def _dump_lines(obj: dict) -> str:
    """A dict as JSON with one top-level entry per line, and one line per element of a top-level list or
    dict (a run's curve row, a part's answer): compact, and a change shows as a changed line."""
    def value(v):
        if isinstance(v, list) and v:
            return "[\n" + ",\n".join(_compact(x) for x in v) + "\n]"
        if isinstance(v, dict) and v:
            return "{\n" + ",\n".join(f"{json.dumps(k)}:{_compact(x)}" for k, x in sorted(v.items())) + "\n}"
        return _compact(v)
    return "{\n" + ",\n".join(f"{json.dumps(k)}:{value(v)}" for k, v in sorted(obj.items())) + "\n}\n"


def _curve(rec: dict, metrics: list[dict]) -> None:
    """A metrics curve into ``rec``: as columns and rows when every row has the same keys (compact)."""
    cols = sorted(metrics[0]) if metrics else []
    if all(sorted(r) == cols for r in metrics):
        rec["columns"], rec["rows"] = cols, [[r[c] for c in cols] for r in metrics]
    else:
        rec["metrics"] = metrics


def _uncurve(rec: dict) -> list[dict]:
    if "error" in rec:
        raise StoreError(rec["error"])
    if "rows" in rec:
        return [dict(zip(rec["columns"], row)) for row in rec["rows"]]
    return list(rec["metrics"])


def _frame_text(df) -> tuple[str, dict]:
    return df.to_csv(index=False), {c: str(t) for c, t in df.dtypes.items()}


def _read_frame(text: str, dtypes: dict):
    """A frame as ``_frame_text`` wrote it: floats round trip (pandas >= 3 by default), dtypes restored."""
    import pandas as pd
    if not text.strip():
        return pd.DataFrame()
    exact = {} if int(pd.__version__.split(".")[0]) >= 3 else {"float_precision": "round_trip"}
    df = pd.read_csv(io.StringIO(text), **exact)
    for c, t in dtypes.items():
        if c in df and str(df[c].dtype) != t:
            try:
                df[c] = df[c].astype(t)
            except (TypeError, ValueError):
                pass
    return df


# -------------------------------------------------------------------------------------- writing
class Recorder:
    """A source seen through a bundle being written: the part ``part`` of the bundle at ``bundle_dir``.
    Every question is answered by ``source`` (a store), written into the bundle, and answered with what
    the bundle gives back, so that a report written through it and one written from the bundle read the
    same values. Attributes it does not define (``root``, ``load_model``, ``load_snapshots``: what a
    computation reads) are the store's. ``close`` writes the part and the records its runs name."""

    def __init__(self, source, bundle_dir: str | Path, part: str, keep: bool = False):
        self._source, self._dir, self._part, self._keep = source, Path(bundle_dir), part, keep
        self._asked: dict[str, bool] = {}
        self._runs: dict[str, dict] = {}
        self._curves: dict[str, dict] = {}
        self._answers: dict[tuple[str, str], dict] = {}
        self._frames: dict[tuple[str, str], dict] = {}

    def __getattr__(self, name):
        return getattr(self._source, name)

    def is_done(self, run_id: str) -> bool:
        done = bool(self._source.is_done(run_id))
        self._asked[run_id] = done
        if done:
            self._run(run_id)
        return done

    def _run(self, run_id: str) -> dict:
        if run_id not in self._runs:
            f = self._dir / "summaries" / f"{run_id}.json"
            if self._keep and f.is_file():  # a run the bundle holds already (its numbers depend on its config alone)
                text = f.read_text()
            else:
                text = _dump_lines(self._source.summary(run_id))
                _replace_file(f, text)
            self._runs[run_id] = json.loads(text)
            self._asked.setdefault(run_id, True)
        return self._runs[run_id]

    def summary(self, run_id: str) -> dict:
        return dict(self._run(run_id))

    def metrics(self, run_id: str) -> list[dict]:
        """The run's curve, written to ``curves/RUN_ID.json`` when a report first reads it (the
        calibration's runs are read by their summaries alone)."""
        if run_id not in self._curves:
            self._run(run_id)
            rec: dict = {}
            try:
                _curve(rec, self._source.metrics(run_id))
            except StoreError as e:  # a damaged run: the reports that read its curve skip it or fail alike
                rec["error"] = " ".join(str(e).split())
            text = _dump_lines(rec)
            _replace_file(self._dir / "curves" / f"{run_id}.json", text)
            self._curves[run_id] = json.loads(text)
        return _uncurve(self._curves[run_id])

    def derived(self, kind: str, keys: list[dict], compute, *, frame=False, encode=None, decode=None) -> list:
        values = list(compute())
        if len(values) != len(keys):
            raise ValueError(f"{kind}: {len(keys)} keys but {len(values)} answers")
        out = []
        for key, value in zip(keys, values):
            key = json.loads(_canon(key))  # as it reads back
            h = _digest(kind, key)
            if frame:
                text, dtypes = _frame_text(value)
                name = f"frames/{kind}/{h}.csv"
                _replace_file(self._dir / name, text)
                self._frames[(kind, h)] = {"kind": kind, "key": key, "file": name, "dtypes": dtypes}
                out.append(_read_frame(text, dtypes))
            else:
                stored = json.loads(_dump(encode(value) if encode else value))  # as the part's file holds it
                self._answers[(kind, h)] = {"kind": kind, "key": key, "value": stored}
                back = json.loads(_dump(stored))
                out.append(decode(back) if decode else back)
        return out

    def close(self) -> None:
        """Write ``parts/PART.json`` and ``records/HASH.json`` for every record the part's runs name."""
        part = {"runs": dict(sorted(self._asked.items())),
                "answers": [self._answers[k] for k in sorted(self._answers)],
                "frames": [self._frames[k] for k in sorted(self._frames)]}
        _replace_file(self._dir / "parts" / f"{self._part}.json", _dump_lines(part))
        named = {r.get("calibration") for r in self._runs.values()} - {None, ""}
        if named:
            for rec in self._records():
                if rec.get("hash") in named:
                    _replace_file(self._dir / "records" / f"{rec['hash']}.json", _dump(rec))

    def _records(self) -> list[dict]:
        from .preregistration import all_shipped_records
        own = getattr(self._source, "calibration_records", None)
        return [*(own() if own is not None else []), *all_shipped_records()]


class BundleWriter:
    """A bundle written into ``DIR.partial`` (``dir``: where recorders write) and moved to ``DIR`` by
    ``finish``: a bundle is whole or absent, and never mixes two writings."""

    def __init__(self, final_dir: str | Path):
        self.final = Path(final_dir)
        self.dir = self.final.with_name(self.final.name + ".partial")
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)

    def recorder(self, source, part: str) -> Recorder:
        return Recorder(source, self.dir, part)

    def finish(self, manifest: dict) -> Path:
        from .provenance import code_version, provenance
        body = {"format": FORMAT, "written_by": code_version(provenance()), **manifest}
        _replace_file(self.dir / MANIFEST, _dump(body))
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.dir, self.final)
        return self.final


def add_part(path: str | Path, source, part: str, write, *, space: str | None = None,
             first_rows: dict[str, float | None] | None = None, doc: str | Path | None = None):
    """Record part ``part`` into the finished bundle at ``path`` from ``source``, a store other than
    the one the bundle was written from (a search's own store): ``write(recorder)`` asks its questions
    through a ``Recorder``; the part replaces an earlier part of that name, and the manifest lists
    ``space`` among its calibration spaces and every record the part holds, with the start of the first
    prediction row under it in ``source`` (``first_rows``: ``store.record_clock.first_rows``), the clock
    a report outside git checks its age by; and ``doc`` as the calibration document where the manifest
    names none. A run the bundle holds already keeps its summary. Returns what ``write`` returns; a
    falsy answer (nothing to record) leaves the bundle as it was. Written in place (a bundle written
    whole is ``BundleWriter``'s): a part killed half-way is written again by the same command."""
    root = find_bundle(path)
    manifest = _manifest(root)
    rec = Recorder(source, root, part, keep=True)
    result = write(rec)
    if not result:
        return result
    rec.close()
    docs = manifest.setdefault("docs", {})
    if doc is not None and not docs.get("calibration"):
        docs["calibration"] = Path(os.path.relpath(Path(doc).resolve(), root.parent.resolve())).as_posix()
    named = {r.get("calibration") for r in rec._runs.values()} - {None, ""}
    listed = manifest.setdefault("records", {})
    for h in sorted(named):
        if (root / "records" / f"{h}.json").is_file():  # the earliest first row either store saw
            times = [t for t in ((listed.get(h) or {}).get("first_row"), (first_rows or {}).get(h)) if t is not None]
            listed[h] = {"first_row": min(times) if times else None}
    if space is not None and space not in {s["name"] for s in manifest.setdefault("spaces", [])}:
        manifest["spaces"].append({"name": space})
    _replace_file(root / MANIFEST, _dump(manifest))
    return result


def write_ledger(bundle_dir: str | Path, rows: list[dict], kinds: dict[int, str]) -> Path:
    """The time ledger into a bundle (``bundle_dir``: a ``BundleWriter.dir`` or a finished bundle):
    ``rows`` as ``RunStore.ledger`` gives them, ``kinds`` a job row's kind by its id (what the store's
    run configs say of it, which a bundle cannot ask later). One row a line."""
    body = {"rows": rows, "kinds": {str(i): k for i, k in sorted(kinds.items())}}
    path = Path(bundle_dir) / LEDGER
    _replace_file(path, _dump_lines(body))
    return path


# -------------------------------------------------------------------------------------- reading
def _manifest(root: Path) -> dict:
    """The manifest of the bundle at ``root`` (``find_bundle``), refused unless it is this ``FORMAT``."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except ValueError as e:
        raise BundleError(f"results bundle {str(root)!r}: unreadable {MANIFEST} ({e})") from None
    fmt = manifest.get("format")
    if fmt != FORMAT:
        raise BundleError(f"results bundle {str(root)!r} is format {fmt!r}; this softprior reads format "
                          f"{FORMAT}: regenerate it with `softprior reproduce paper`")
    return manifest


def read_ledger(path: str | Path) -> tuple[list[dict], dict[int, str]]:
    """A bundle's time ledger (``write_ledger``): its rows, oldest first, and each job's kind by row id.
    A ``BundleError`` where the bundle has none (written before bundles carried it) or another format."""
    root = find_bundle(path)
    _manifest(root)
    f = root / LEDGER
    if not f.is_file():
        raise BundleError(f"the results bundle {str(root)!r} holds no time ledger ({LEDGER}): it was written "
                          "before bundles carried one; `softprior report paper --store S` writes it")
    try:
        body = json.loads(f.read_text())
        return list(body["rows"]), {int(i): k for i, k in body["kinds"].items()}
    except (ValueError, KeyError, TypeError) as e:
        raise BundleError(f"results bundle {str(root)!r}: unreadable {LEDGER} ({e})") from None


def find_bundle(path: str | Path) -> Path:
    """The bundle at ``path``: the directory holding ``manifest.json``, or its ``bundle/`` subdirectory
    (``docs/results`` names ``docs/results/bundle``)."""
    p = Path(path)
    for d in (p / "bundle", p):
        if (d / MANIFEST).is_file():
            return d
    raise BundleError(f"no results bundle at {str(p)!r} (no {MANIFEST} in it or in {str(p / 'bundle')!r}): "
                      "`softprior reproduce paper` (or `report paper` from a store) writes one under its --out")


class BundleSource:
    """A bundle as a source: the questions a report asks of a store, answered from files (module
    docstring). Read-only; it holds no weights, so a question that would need them and was not
    recorded is a ``BundleError`` naming it."""

    read_only = True

    def __init__(self, path: str | Path):
        self.root = find_bundle(path)
        self.manifest = _manifest(self.root)
        self._done: dict[str, bool] = {}
        self._answers: dict[tuple[str, str], object] = {}
        self._frames: dict[tuple[str, str], dict] = {}
        for f in sorted((self.root / "parts").glob("*.json")):
            part = json.loads(f.read_text())
            for run_id, done in part["runs"].items():
                self._done[run_id] = self._done.get(run_id, False) or bool(done)
            for a in part["answers"]:
                self._answers[(a["kind"], _digest(a["kind"], a["key"]))] = a["value"]
            for fr in part["frames"]:
                self._frames[(fr["kind"], _digest(fr["kind"], fr["key"]))] = fr
        self._runs: dict[str, dict] = {}
        self.records = {r["hash"]: r for r in self.calibration_records()}  # each proves itself, or is refused

    @property
    def results_dir(self) -> Path:
        """The results directory the bundle sits in (``docs/results`` for ``docs/results/bundle``)."""
        return self.root.parent

    def _missing(self, what: str) -> BundleError:
        return BundleError(f"the results bundle {str(self.root)!r} holds no {what}: it was written for other "
                           "runs or questions (the experiments, the options or the report code changed since): "
                           "regenerate it from the store with `softprior reproduce paper`")

    def is_done(self, run_id: str) -> bool:
        if run_id not in self._done:
            raise self._missing(f"run {run_id}")
        return self._done[run_id]

    def _file(self, run_id: str, folder: str, what: str) -> dict:
        f = self.root / folder / f"{run_id}.json"
        if not self._done.get(run_id) or not f.is_file():
            raise self._missing(f"{what} of finished run {run_id}")
        return json.loads(f.read_text())

    def summary(self, run_id: str) -> dict:
        if run_id not in self._runs:
            self._runs[run_id] = self._file(run_id, "summaries", "summary")
        return dict(self._runs[run_id])

    def metrics(self, run_id: str) -> list[dict]:
        return _uncurve(self._file(run_id, "curves", "metrics curve"))

    def derived(self, kind: str, keys: list[dict], compute=None, *, frame=False, encode=None, decode=None) -> list:
        out = []
        for key in keys:
            h = _digest(kind, json.loads(_canon(key)))
            if frame:
                fr = self._frames.get((kind, h))
                if fr is None:
                    raise self._missing(f"{kind} for {_canon(key)[:200]}")
                out.append(_read_frame((self.root / fr["file"]).read_text(), fr["dtypes"]))
            else:
                if (kind, h) not in self._answers:
                    raise self._missing(f"{kind} for {_canon(key)[:200]}")
                v = json.loads(_dump(self._answers[(kind, h)]))
                out.append(decode(v) if decode else v)
        return out

    def calibration_records(self) -> list[dict]:
        """The records the bundle holds, each verified (``preregistration.read_record``: a forged or edited one
        is refused, naming its file)."""
        from .preregistration import read_record
        return [read_record(f) for f in sorted((self.root / "records").glob("*.json"))]

    def record_first_rows(self, named) -> dict[str, float | None]:
        """Record hash -> the first prediction row's start under it, for the hashes ``named``, from the
        manifest's ``records``. A record the bundle holds or a run names that the manifest does not list
        (swapped or rehashed after the bundle was written) is refused, one line naming its file."""
        from .preregistration import RecordRefused
        listed = self.manifest.get("records")
        if not isinstance(listed, dict):
            raise BundleError(f"results bundle {str(self.root)!r}: its manifest carries no record hashes and first-row "
                              "times (written before bundles did): regenerate it with `softprior reproduce paper`")
        held = {f.stem for f in (self.root / "records").glob("*.json")}
        for h in sorted(held | set(named)):
            if h not in listed:
                raise RecordRefused(f"{self.root}/records/{h}.json", "the bundle's manifest does not list this "
                                    "record: it was added or rewritten after the bundle was written")
        return {h: (listed[h] or {}).get("first_row") for h in named}

    def _no_weights(self, what: str):
        raise BundleError(f"the results bundle {str(self.root)!r} holds no weights: {what} needs the run store "
                          "(an answer the bundle was not written with; regenerate it with `softprior reproduce paper`)")

    def load_model(self, run_id: str):
        self._no_weights(f"run {run_id}'s model")

    def load_snapshots(self, run_id: str):
        self._no_weights(f"run {run_id}'s snapshots")

    def load_state(self, run_id: str):
        self._no_weights(f"run {run_id}'s weights")
