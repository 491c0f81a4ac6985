"""``softprior report timings``: the time ledger of a store or of a results bundle."""

from __future__ import annotations

import json

from .common import CliError, _store


def _ledger_kind(store):
    """A job row's kind for ``report timings``: task/size (``reports.timings.job_kind``), and the positional scheme
    where there is one, read from the store's config of its first run."""
    from ..reports.timings import job_kind
    from ..store.errors import StoreError

    def kind_of(row) -> str:
        try:
            pos = store.load_config(row["detail"]["run_ids"][0]).model.positional
        except (StoreError, KeyError, IndexError, OSError, ValueError):
            return job_kind(row)
        return job_kind(row) + ("" if pos in (None, "none") else f" {pos}")
    return kind_of


def _until(text: str | None) -> float | None:
    """--until: an ISO 8601 date or time (UTC where it names no zone) or unix seconds, as unix seconds."""
    if text is None:
        return None
    import datetime
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"--until must be an ISO 8601 time (e.g. 2026-12-06T03:00, UTC unless it names a zone) "
                       f"or unix seconds, got {text!r}") from None
    return (when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)).timestamp()


def cmd_report_timings(args) -> int:
    """``report timings``: the store's time ledger (``reports.timings.ledger_summary``), or the one a results bundle
    carries (--from-bundle): the paper's wall time, its FLOP, the floor at the GEMM rate and the ratio,
    and the costliest jobs; by default only the rows of the code version this checkout is
    (``provenance.code_version``), another with --code-version, all with --all-versions; rows started
    before --until only; and where the time goes, per kind of job (task/size and positional scheme)."""
    if args.gemm_rate is not None and not args.gemm_rate > 0:
        raise CliError(f"--gemm-rate must be a positive number of GFLOP/s, got {args.gemm_rate}")
    if args.top < 0:
        raise CliError(f"--top must be >= 0, got {args.top}")
    if args.all_versions and args.code_version:
        raise CliError("--all-versions and --code-version contradict each other: give one")
    until = _until(args.until)
    from ..reports.timings import format_timings, job_kind, ledger_summary
    from ..provenance import code_version, provenance
    if args.from_bundle:
        from ..bundle import read_ledger
        rows, kinds = read_ledger(args.from_bundle)

        def kind_of(row) -> str:
            return kinds.get(row["id"]) or job_kind(row)
        where = {"bundle": str(args.from_bundle)}
    else:
        store = _store(args, read_only=True)
        rows, kind_of, where = store.ledger(), _ledger_kind(store), {"store": str(args.store)}
    if args.code_version and not any(r.get("code_version") == args.code_version for r in rows):
        known = sorted({r.get("code_version") or "?" for r in rows})
        raise CliError(f"--code-version {args.code_version!r}: the time ledger has no row of it; it has "
                       f"{', '.join(known) or 'no rows'}")
    before = [r for r in rows if until is None or r["started_at"] < until]
    version = None if args.all_versions else args.code_version or code_version(provenance())
    t = ledger_summary(before, version, rate=args.gemm_rate, top=args.top, kind_of=kind_of)
    t.update(where, until=until, rows_after_until=len(rows) - len(before))
    print(json.dumps(t, sort_keys=True) if args.json else format_timings(t))
    return 0
