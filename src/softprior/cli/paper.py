"""``softprior reproduce paper`` and ``softprior report paper``: every experiment, one sweep (and more seeds
where a cell is undecided), every table, RESULTS.md, CALIBRATION.md's blocks, the README's verdicts
and the results bundle; or, with --from-bundle, the same documents from a bundle."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .common import CliError, CliFailure, _group_shown, _refuse_dirty_training, _store
from .outputs import _check_outputs, _doc_file, _record_report
from .timings import _ledger_kind


def _from_bundle(args):
    """``report paper --from-bundle DIR``: the bundle as the source, and what it was written with (the
    options, the experiments, the calibration spaces, exploratory or not, where the documents went,
    relative to --out, by default the results directory the bundle sits in)."""
    from ..bundle import BundleSource
    from ..experiments import Options
    source = BundleSource(args.from_bundle)
    m = source.manifest
    o = m["options"]
    opts = Options(seeds=o["seeds"], quick=o["quick"], tasks=tuple(o["tasks"]) if o["tasks"] is not None else None,
                   extend=tuple(tuple(x) for x in o.get("extend", ())), extend_seeds=o.get("extend_seeds"),
                   record=o.get("record"))
    given = {"--seeds": (args.seeds, opts.seeds), "--tasks": (args.tasks and tuple(
        t.strip() for t in args.tasks.split(",")), opts.tasks), "--quick": (args.quick or None, opts.quick or None),
        "--record": (getattr(args, "record", None), opts.record)}
    for flag, (mine, theirs) in given.items():
        if mine is not None and mine != theirs:
            raise CliError(f"{flag}: the bundle {str(source.root)!r} was written with {flag} {theirs!r}; "
                           "a bundle regenerates the documents it was written for (omit the flag)")
    out = Path(args.out) if args.out else source.results_dir
    docs = m.get("docs", {})

    def where(flag_value, key):
        return flag_value if flag_value is not None else (str(out / docs[key]) if docs.get(key) else None)
    notes = source.results_dir / "NOTES.md"
    if notes.is_file() and not (out / "NOTES.md").exists():  # the fixed prose of RESULTS.md
        out.mkdir(parents=True, exist_ok=True)
        (out / "NOTES.md").write_text(notes.read_text())
    return (source, opts, m["experiments"], out, where(args.doc, "results") or str(out / "RESULTS.md"),
            where(args.readme, "readme"),
            where(args.calibration_doc, "calibration"), [s["name"] for s in m.get("spaces", [])],
            args.exploratory or bool(m.get("exploratory")))


def _only(args, names: list[str]) -> list[str]:
    """The paper's experiments ``names``, those of ``reproduce paper --only`` alone where it is given."""
    if not getattr(args, "only", None):  # reproduce only
        return names
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    bad = [n for n in only if n not in names]
    if bad:
        raise CliError(f"--only: {', '.join(map(repr, bad))} not among the experiments of 'paper' here "
                       f"({', '.join(names)})")
    return [n for n in names if n in only]


def _paper_sweep(args, store, cfgs) -> int:
    """One training sweep of the paper; how many runs failed."""
    from ..executors.sweep import execute
    t0 = time.perf_counter()
    report = execute(cfgs, store, executor=args.executor, workers=args.workers, group_size=args.group,
                     address=args.address, progress=not args.no_progress, require_calibration=not args.exploratory)
    print(report.line() + f" ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return len(report.failed)


def _check_paper_args(args) -> None:
    if args.seeds is not None and args.seeds < 1:
        raise CliError(f"--seeds must be >= 1, got {args.seeds}")
    if args.workers < 1:
        raise CliError(f"--workers must be >= 1, got {args.workers}")
    _doc_file(getattr(args, "calibration_doc", None), "--calibration-doc")


def _splice_verdicts(readme, out) -> None:
    """The README's answer: the verdicts in plain words, then the same claims on every record whose tables ran."""
    from ..paper import cross_regime_summary, load_tables, verdict_summary
    from ..reports.experiment import splice_into_doc
    cross = cross_regime_summary(out)
    splice_into_doc(readme, "verdicts", verdict_summary(load_tables(out)) + ("\n\n" + cross if cross else ""))


def _paper(args, train: bool) -> int:
    """``reproduce paper`` / ``report paper``: every experiment, one sweep, every table, RESULTS.md (and
    CALIBRATION.md's blocks with --calibration-doc), and the results bundle ``OUT/bundle`` of everything
    they read (``softprior.bundle``); or, with --from-bundle, the same documents from a bundle."""
    from pathlib import Path

    from . import main
    from ..experiments import Options
    from ..plugins import load_plugin
    from ..paper import (CALIBRATION_SPACES, ON_RECORD, OURS, PAPER, paper_cells, write_calibration_docs,
                        write_reports, write_results_doc)
    from ..reports.experiment import check_clean
    for f in args.plugin or []:
        load_plugin(f)
    _check_paper_args(args)
    if getattr(args, "from_bundle", None):
        store, opts, names, out, doc, readme, cal_doc, spaces, exploratory = _from_bundle(args)
        exps = paper_cells(opts, names)
        args.out = str(out)
        _check_outputs(args, "results")
        bundle = None
    else:
        tasks = tuple(t.strip() for t in args.tasks.split(",")) if args.tasks else None
        opts = Options(seeds=args.seeds, quick=args.quick, tasks=tasks, record=args.record)
        names = _only(args, ON_RECORD if opts.record else PAPER + OURS)
        exploratory = args.exploratory
        exps = paper_cells(opts, names)
        _check_outputs(args, "results")
        store = _store(args, read_only=not train)
        out = Path(args.out or "results")
        doc, readme, cal_doc = args.doc or str(out / "RESULTS.md"), args.readme, args.calibration_doc
        spaces = CALIBRATION_SPACES
        bundle = out / "bundle"
    failed = 0
    if train:
        cfgs = list({c.cfg.run_id: c.cfg for _, cells in exps for c in cells}.values())
        _refuse_dirty_training(cfgs, store, exploratory)
        print(f"paper: {len(exps)} experiments, {len(cfgs)} distinct runs, store {args.store}, executor "
              f"{args.executor} x{args.workers}, group size {_group_shown(args, cfgs, store)}", file=sys.stderr)
        failed = _paper_sweep(args, store, cfgs)
    if not getattr(args, "from_bundle", None) and opts.seeds is None and not opts.quick:
        opts, exps, more = _more_seeds(store, opts, names, exps)
        if more and train:
            _refuse_dirty_training(more, store, exploratory)
            print(f"paper: {len(opts.extend)} cell(s) undecided at the paper's seed counts, run on up to "
                  f"{opts.extend_seeds} seeds: {len(more)} more runs", file=sys.stderr)
            failed += _paper_sweep(args, store, more)
    check_clean(store, exps, exploratory)  # before any file is written: every table's runs at once
    writer = None
    if bundle is not None:
        from ..bundle import BundleWriter
        writer = BundleWriter(bundle)
    write_reports(store, exps, out, opts=opts, workers=args.workers, plugins=args.plugin or (),
                  on_report=lambda *a: _record_report(store, *a), bundle=writer.dir if writer else None,
                  exploratory=exploratory)
    # the searches first: RESULTS.md shows an identification or effect search's section (paper.search_sections)
    written = write_calibration_docs(store, cal_doc, out, spaces, bundle=writer.dir if writer else None) \
        if cal_doc else []
    if getattr(args, "from_bundle", None):  # the bundles of the paper on other records it holds, then their section
        from ..paper import ON_RECORD_DIR
        for sub in sorted((store.results_dir / ON_RECORD_DIR).glob("*/bundle/manifest.json")):
            here = sub.parent.parent
            if main(["report", "paper", "--from-bundle", str(here), "--out", str(out / ON_RECORD_DIR / here.name),
                     "--workers", str(args.workers)]) != 0:
                raise CliFailure(f"the bundle {str(here)!r} inside {str(store.root)!r} did not regenerate")
    started, t0 = time.time(), time.perf_counter()
    write_results_doc(out, doc, names=[e.name for e, _ in exps], spaces=written, record=opts.record)
    _record_report(store, "RESULTS.md", started, time.perf_counter() - t0, 0)
    if readme:  # the verdicts at a glance, generated from the same tables
        _splice_verdicts(readme, out)
    if writer is not None:
        _finish_bundle(writer, store, opts, exps, written, exploratory, out, doc, readme, cal_doc)
    print(Path(doc).read_text().split("\n## ", 2)[1] if "\n## " in Path(doc).read_text() else "")
    print(f"wrote {len(exps)} experiments under {out}/ and {doc}" + (f", the bundle {bundle}/" if writer else "")
          + (f"; updated {cal_doc} ({', '.join(written)})" if written else "")
          + (f"; updated {readme} (its verdict list)" if readme else ""), file=sys.stderr)
    return 1 if failed else 0


def _finish_bundle(writer, store, opts, exps, written, exploratory, out, doc, readme, cal_doc) -> None:
    """The results bundle's last part: the time ledger (this report's rows included), each record's first
    prediction row (its age, for a report outside git), and the manifest that ``report paper --from-bundle``
    rewrites the documents from."""
    from ..bundle import write_ledger
    from ..store.record_clock import first_rows
    rows = store.ledger()
    kind_of = _ledger_kind(store)
    write_ledger(writer.dir, rows, {r["id"]: kind_of(r) for r in rows if r["kind"] == "job"})

    def rel(p):
        return Path(os.path.relpath(Path(p).resolve(), out.resolve())).as_posix() if p else None
    first = first_rows(store.index.rows())
    held = sorted(f.stem for f in (writer.dir / "records").glob("*.json"))
    writer.finish({"records": {h: {"first_row": first.get(h)} for h in held},
                   "options": {"seeds": opts.seeds, "quick": opts.quick,
                               "tasks": list(opts.tasks) if opts.tasks is not None else None,
                               "record": opts.record,
                               "extend": [list(x) for x in opts.extend], "extend_seeds": opts.extend_seeds},
                   "experiments": [e.name for e, _ in exps], "spaces": [{"name": s} for s in written],
                   "exploratory": bool(exploratory),
                   "docs": {"results": rel(doc), "readme": rel(readme), "calibration": rel(cal_doc) if written
                            else None}})


def _more_seeds(store, opts, names, exps):
    """At the paper's seed counts: the cells whose condition is undecided there (``paper.more_seeds``,
    decided on those seeds' runs alone, and only once every one of them is stored, so that a partly
    trained store cannot decide otherwise than the finished one) get seeds up to ``paper.MAX_SEEDS``.
    Returns the options with the extension, their (experiment, cells), and the added runs not yet in
    ``store``; says so when runs of the paper's seeds are missing."""
    import dataclasses

    from ..paper import MAX_SEEDS, claim_tables, more_seeds, paper_cells
    missing = sum(not store.is_done(c.cfg.run_id) for _, cells in exps for c in cells)
    if missing:
        print(f"paper: {missing} run(s) of the paper's seeds are not stored, so no cell is given more seeds yet "
              "(decided once they all are)", file=sys.stderr)
        return opts, exps, []
    extend = more_seeds(claim_tables(store, exps))
    if not extend:
        return opts, exps, []
    opts = dataclasses.replace(opts, extend=extend, extend_seeds=MAX_SEEDS)
    wider = paper_cells(opts, names)
    have = {c.cfg.run_id for _, cells in exps for c in cells}
    more = list({c.cfg.run_id: c.cfg for _, cells in wider for c in cells
                 if c.cfg.run_id not in have and not store.is_done(c.cfg.run_id)}.values())
    return opts, wider, more
