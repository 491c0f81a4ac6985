"""The time ledger (issue 29, item 1): every job of a sweep, every report and every sweep leaves a row
in the store (wall time, FLOP trained, code version), and `softprior report timings` sums them
against the arithmetic floor. No wall-clock thresholds: only what the rows must say of each other."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch

from softprior.cli import main
from softprior.cli.outputs import _record_report
from softprior.executors.sweep import execute
from softprior.provenance import code_version, provenance
from softprior.store import RunStore
from softprior.tasks.generators import make_task

from conftest import tiny_config

STEPS = 12


def _by_hand_flops(cfg) -> float:
    """Matmul FLOPs of one training step, counted here from the shapes (forward x 3; the last layer
    at the loss positions only), the count ``flops.train_step_flops`` documents."""
    m, B, T = cfg.model, cfg.batch_size, cfg.model.n_ctx
    P = len(make_task(cfg.task).loss_positions(T))
    fwd = 2 * B * P * m.d_model * m.vocab  # tied unembedding
    for layer in range(m.n_layers):
        Tq = P if layer == m.n_layers - 1 else T
        proj = 2 * B * (T * m.d_model * (2 * m.d_model + m.n_heads * m.content_rank)
                        + Tq * m.d_model * (m.d_model + m.n_heads * m.content_rank) + Tq * m.d_model * m.d_model)
        attn = 2 * B * m.n_heads * Tq * T * (2 * m.d_head + m.content_rank)
        fwd += proj + attn
    return 3 * fwd


def _cfgs():
    return [tiny_config(path=p, seed=s, steps=STEPS) for s, p in enumerate(["unforced", "fade600", "unforced"])]


def _jobs(store):
    return [r for r in store.ledger() if r["kind"] == "job"]


def _timings(capsys, store_dir, *flags) -> dict:
    capsys.readouterr()
    assert main(["report", "timings", "--store", str(store_dir), "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_sweep_writes_one_row_per_job_with_its_seconds_and_flop(tmp_path):
    cfgs = _cfgs()
    store = RunStore(tmp_path / "s")
    rep = execute(cfgs, store, group_size=2, progress=False, require_calibration=False)
    assert rep.ok and rep.trained == 3
    jobs, by_id = _jobs(store), {c.run_id: c for c in cfgs}
    assert sorted(len(r["detail"]["run_ids"]) for r in jobs) == [1, 2]  # a group of two and a run alone
    assert sorted(i for r in jobs for i in r["detail"]["run_ids"]) == sorted(by_id)
    version = code_version(provenance())
    for r in jobs:
        runs = [by_id[i] for i in r["detail"]["run_ids"]]
        assert r["seconds"] > 0 and r["runs"] == len(runs) and r["detail"]["status"] == "ok"
        assert r["flop"] == pytest.approx(sum(_by_hand_flops(c) * STEPS for c in runs), rel=1e-12)
        assert r["detail"]["steps"] == STEPS * len(runs)
        assert r["detail"]["pieces"] == [[r["started_at"], r["seconds"]]]  # one piece: nothing resumed
        assert r["code_version"] == version and r["gemm_gflops"] > 0  # the rate the sweep measured
    (sweep,) = [r for r in store.ledger() if r["kind"] == "sweep"]
    assert sweep["runs"] == 3 and sweep["seconds"] >= max(r["seconds"] for r in jobs)
    # a sweep with nothing left to train adds nothing
    execute(cfgs, store, group_size=2, progress=False, require_calibration=False)
    assert len(store.ledger()) == 3


def test_report_timings_sums_the_ledger_against_the_floor(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SOFTPRIOR_GEMM_GFLOPS", "40")  # what the sweep records: no measuring here
    cfgs = _cfgs()
    store = RunStore(tmp_path / "s")
    execute(cfgs, store, group_size=3, progress=False, require_calibration=False)
    rows = store.ledger()
    jobs = [r for r in rows if r["kind"] == "job"]
    t = _timings(capsys, tmp_path / "s", "--gemm-rate", "50")
    flop = sum(r["flop"] for r in jobs)
    assert flop == pytest.approx(sum(_by_hand_flops(c) * STEPS for c in cfgs), rel=1e-12)
    assert t["flop"] == pytest.approx(flop, rel=1e-12) and t["gemm_gflops"] == 50.0
    assert t["job_seconds"] == pytest.approx(sum(r["seconds"] for r in jobs), rel=1e-12)
    # serial: the jobs lie inside the sweep, so the paper's time is the sweep's wall time (to the
    # resolution of a unix time, ~0.2 us)
    (sweep,) = [r for r in rows if r["kind"] == "sweep"]
    assert t["wall_seconds"] == pytest.approx(sweep["seconds"], abs=1e-5)
    assert t["floor_seconds"] == pytest.approx(flop / 50e9, rel=1e-12)
    assert t["ratio"] == pytest.approx(t["wall_seconds"] / (flop / 50e9), rel=1e-12)
    assert [c["seconds"] for c in t["costliest"]] == sorted((r["seconds"] for r in jobs), reverse=True)
    assert t["costliest"][0]["gflops"] == pytest.approx(jobs[0]["flop"] / jobs[0]["seconds"] / 1e9)
    # where the time goes: one kind (task/size, no positional scheme), every job's seconds and FLOP
    from softprior.model.config import size_label
    (kind, k), = t["kinds"].items()
    assert kind == f"{cfgs[0].task.name}/{size_label(cfgs[0].model)}" and k["runs"] == len(cfgs)
    assert k["seconds"] == pytest.approx(t["job_seconds"]) and k["flop"] == pytest.approx(flop)
    # without --gemm-rate: the rate the sweep recorded
    assert _timings(capsys, tmp_path / "s")["gemm_gflops"] == 40.0
    assert main(["report", "timings", "--store", str(tmp_path / "s"), "--gemm-rate", "50"]) == 0
    text = capsys.readouterr().out
    assert f"{t['ratio']:.2f}x the floor" in text and "costliest jobs" in text


def test_a_resumed_sweep_adds_only_the_new_pieces(tmp_path, monkeypatch):
    """A sweep killed after its group's 6th checkpoint leaves no row; the next one resumes the group
    and writes one row whose seconds are its two pieces' and whose FLOP is every step's; a third adds
    nothing. The runs end with the bits of an uninterrupted sweep (timing changes no number)."""
    from softprior.store.files import RunFiles
    cfgs = _cfgs()[:2]
    save, calls = RunFiles.save_group_checkpoint, []

    def killed_after_six(self, run_ids, ck):
        save(self, run_ids, ck)
        calls.append(ck["meta"]["step"])
        if len(calls) == 6:
            raise KeyboardInterrupt  # as if the sweep were killed right after writing the checkpoint

    store = RunStore(tmp_path / "s")
    monkeypatch.setattr(RunFiles, "save_group_checkpoint", killed_after_six)
    with pytest.raises(KeyboardInterrupt):
        execute(cfgs, store, group_size=2, progress=False, require_calibration=False, checkpoint_seconds=0.0)
    monkeypatch.setattr(RunFiles, "save_group_checkpoint", save)
    assert store.ledger() == [] and calls[-1] == 6

    execute(cfgs, store, group_size=2, progress=False, require_calibration=False, checkpoint_seconds=0.0)
    (job,) = _jobs(store)
    first, second = job["detail"]["pieces"]
    assert first[1] > 0 and second[1] > 0 and first[0] < second[0]
    assert job["seconds"] == pytest.approx(first[1] + second[1], rel=1e-12) and job["started_at"] == first[0]
    assert job["detail"]["from_step"] == 0 and job["detail"]["steps"] == 2 * STEPS
    assert job["flop"] == pytest.approx(sum(_by_hand_flops(c) * STEPS for c in cfgs), rel=1e-12)
    assert all(store.summary(c.run_id)["resumed_at"] == 6 for c in cfgs)
    n = len(store.ledger())
    execute(cfgs, store, group_size=2, progress=False, require_calibration=False)
    assert len(store.ledger()) == n

    clean = RunStore(tmp_path / "clean")
    execute(cfgs, clean, group_size=2, progress=False, require_calibration=False)
    for c in cfgs:
        assert store.metrics(c.run_id) == clean.metrics(c.run_id)
        a, b = store.load_state(c.run_id), clean.load_state(c.run_id)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_pieces_on_different_days_add_and_concurrent_jobs_count_once():
    from softprior.reports.timings import ledger_summary
    day = 86400.0

    def job(start, sec, flop, version="v"):
        return {"kind": "job", "name": f"j{start}", "seconds": sec, "flop": flop, "runs": 1, "started_at": start,
                "host": "h", "code_version": version, "gemm_gflops": None,
                "detail": {"pieces": [[start, sec]], "steps": 10}}
    rows = [job(0.0, 10.0, 1e9), job(5.0, 10.0, 1e9),  # two workers at once: 15 s of wall time
            {**job(day, 0, 2e9), "seconds": 7.0, "detail": {"pieces": [[day, 3.0], [2 * day, 4.0]], "steps": 20}},
            {"kind": "report", "name": "r", "seconds": 2.0, "flop": 0.0, "runs": 3, "started_at": 3 * day, "host": "h",
             "code_version": "v", "gemm_gflops": None, "detail": {}},
            job(4 * day, 100.0, 9e9, version="old")]
    t = ledger_summary(rows, "v", rate=1.0)
    assert t["wall_seconds"] == pytest.approx(15 + 3 + 4 + 2) and t["job_seconds"] == pytest.approx(27)
    assert t["flop"] == 4e9 and t["ratio"] == pytest.approx(24 / 4.0) and t["rows_other_versions"] == 1
    assert t["other_versions"] == ["old"] and t["report_seconds"] == 2.0
    everything = ledger_summary(rows, None, rate=1.0)
    assert everything["wall_seconds"] == pytest.approx(124) and everything["flop"] == 13e9


def test_where_the_time_goes_by_hand():
    """Per kind of job: worker-seconds, share, GFLOP/s per worker and x floor. At a GEMM rate of 10
    GFLOP/s and 2 workers a worker's floor rate is 5 GFLOP/s: 100 GFLOP in 40 s is 2.5 GFLOP/s, 2.0x."""
    from softprior.reports.timings import format_timings, ledger_summary

    def job(name, sec, gflop, workers=2):
        return {"kind": "job", "name": name, "seconds": sec, "flop": gflop * 1e9, "runs": 1, "started_at": 0.0,
                "host": "h", "code_version": "v", "gemm_gflops": None,
                "detail": {"pieces": [[0.0, sec]], "steps": 1, "workers": workers}}
    rows = [job("assoc_recall/large fade s0", 30.0, 75.0), job("assoc_recall/large x2: a s0, b s1", 10.0, 25.0),
            job("markov/base unforced s0", 60.0, 30.0, workers=1)]
    t = ledger_summary(rows, "v", rate=10.0)
    large, markov = t["kinds"]["assoc_recall/large"], t["kinds"]["markov/base"]
    assert list(t["kinds"]) == ["markov/base", "assoc_recall/large"]  # costliest first
    assert (large["jobs"], large["runs"], large["seconds"], large["flop"]) == (2, 2, 40.0, 100e9)
    assert large["gflops"] == pytest.approx(2.5) and large["x_floor"] == pytest.approx(2.0)
    assert large["share"] == pytest.approx(0.4) and markov["share"] == pytest.approx(0.6)
    assert markov["x_floor"] == pytest.approx(60.0 / 3.0)  # one worker: the whole rate, 30 GFLOP in 3 s
    text = format_timings(t)
    assert "| assoc_recall/large | 2 | 2 | 40 | 40.0% | 0.1 | 2.5 | 2.00 |" in text
    by_scheme = ledger_summary(rows, "v", rate=10.0, kind_of=lambda r: r["name"].split()[1])
    assert set(by_scheme["kinds"]) == {"fade", "x2:", "unforced"}


def test_reports_are_recorded_and_only_this_code_version_is_summed(tmp_path, capsys):
    store = RunStore(tmp_path / "s")
    _record_report(store, "removability", 1000.0, 2.5, 9)
    store.record_timing("job", "old job", 50.0, 1e12, 4, 2000.0, code_version="0.0.1@0123456789ab")
    _record_report(RunStore(tmp_path / "s", read_only=True), "never", 3000.0, 1.0, 1)  # `report` only reads
    (rep, old) = store.ledger()
    assert (rep["kind"], rep["name"], rep["seconds"], rep["runs"]) == ("report", "removability", 2.5, 9)
    assert rep["code_version"] == code_version(provenance())
    t = _timings(capsys, tmp_path / "s", "--gemm-rate", "100")
    assert (t["rows"], t["rows_other_versions"], t["flop"], t["report_seconds"]) == (1, 1, 0.0, 2.5)
    assert t["ratio"] is None  # nothing trained
    old = _timings(capsys, tmp_path / "s", "--gemm-rate", "100", "--code-version", "0.0.1@0123456789ab")
    assert (old["rows"], old["flop"], old["code_version"]) == (1, 1e12, "0.0.1@0123456789ab")
    assert main(["report", "timings", "--store", str(tmp_path / "s"), "--code-version", "nope"]) == 2
    assert "no row of it" in capsys.readouterr().err
    t = _timings(capsys, tmp_path / "s", "--gemm-rate", "100", "--all-versions")
    assert t["rows"] == 2 and t["flop"] == 1e12 and t["ratio"] == pytest.approx(52.5 / 10.0)


def test_the_ledger_is_append_only_and_read_where_absent(tmp_path, capsys):
    store = RunStore(tmp_path / "s")
    store.record_timing("report", "x", 1.0)
    db = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    for sql in ("UPDATE ledger SET seconds = 0", "DELETE FROM ledger"):
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            db.execute(sql)
    db.execute("DROP TRIGGER ledger_no_delete")  # an index written before the ledger: no table at all
    db.execute("DROP TABLE ledger")
    db.commit()
    db.close()
    assert RunStore(tmp_path / "s", read_only=True).ledger() == []
    with pytest.raises(ValueError, match="kind"):
        store.record_timing("lunch", "x", 1.0)
    assert main(["report", "timings", "--store", str(tmp_path / "s"), "--gemm-rate", "0"]) == 2


def test_where_the_time_goes_names_the_positional_scheme(tmp_path, capsys, monkeypatch):
    """`report timings` splits the breakdown by the run's positional scheme, read from the stored
    config: a RoPE run is its own kind beside the soft-prior runs of the same task and size."""
    from softprior.model.config import size_label
    monkeypatch.setenv("SOFTPRIOR_GEMM_GFLOPS", "40")
    rope = tiny_config(path="unforced", seed=5, steps=STEPS, model_options={"prior": False, "positional": "rope"})
    cfgs = [*_cfgs()[:2], rope]
    store = RunStore(tmp_path / "s")
    execute(cfgs, store, group_size=1, progress=False, require_calibration=False)
    kinds = _timings(capsys, tmp_path / "s")["kinds"]
    base = f"{cfgs[0].task.name}/{size_label(cfgs[0].model)}"
    assert sorted(kinds) == [base, f"{base} rope"]
    assert kinds[base]["runs"] == 2 and kinds[f"{base} rope"]["runs"] == 1
    assert kinds[f"{base} rope"]["flop"] == pytest.approx(_by_hand_flops(rope) * STEPS, rel=1e-12)


def test_until_counts_only_the_rows_started_before_it(tmp_path, capsys):
    """--until: a sweep's time read later, without the sweeps of the same code that followed it (the
    paper's figure before the robustness maps): rows started at or after it are left out."""
    store, version = RunStore(tmp_path / "s"), code_version(provenance())
    for started, seconds, flop in ((1000.0, 10.0, 1e12), (2000.0, 20.0, 2e12), (3000.0, 40.0, 4e12)):
        store.record_timing("job", "assoc_recall/base x", seconds, flop, 1, started, code_version=version)
    whole = _timings(capsys, tmp_path / "s", "--gemm-rate", "100")
    assert (whole["jobs"], whole["wall_seconds"], whole["flop"], whole["until"]) == (3, 70.0, 7e12, None)
    before = _timings(capsys, tmp_path / "s", "--gemm-rate", "100", "--until", "2500")
    assert (before["jobs"], before["wall_seconds"], before["flop"], before["until"]) == (2, 30.0, 3e12, 2500.0)
    assert before["ratio"] == pytest.approx(30.0 / 30.0)
    # the same instant as an ISO time: UTC where it names no zone, its own zone where it names one
    for iso in ("1970-01-01T00:41:40", "1970-01-01T01:41:40+01:00"):
        assert _timings(capsys, tmp_path / "s", "--gemm-rate", "100", "--until", iso) == before
    assert _timings(capsys, tmp_path / "s", "--gemm-rate", "100", "--until", "2000")["jobs"] == 1  # not before
    assert main(["report", "timings", "--store", str(tmp_path / "s"), "--gemm-rate", "100", "--until", "2500"]) == 0
    assert "rows started before 1970-01-01 00:41:40 UTC (--until)" in capsys.readouterr().out
    assert main(["report", "timings", "--store", str(tmp_path / "s"), "--until", "last week"]) == 2
    assert "--until must be an ISO 8601 time" in capsys.readouterr().err
    assert main(["report", "timings", "--store", str(tmp_path / "s"), "--until", "500"]) == 0
    out = capsys.readouterr().out
    assert "no rows of code version" in out and "left out the 3 rows started after it" in out


def test_a_ledger_without_this_versions_rows_names_the_one_to_ask_for(tmp_path, capsys):
    """A fresh clone reads a ledger written by other code (the committed bundle's): the message names
    the version that trained the most, the one to pass to --code-version."""
    store = RunStore(tmp_path / "s")
    for version, seconds in (("0.0.1@aaaaaaaaaaaa", 50.0), ("0.0.1@bbbbbbbbbbbb", 500.0),
                             ("0.0.1@cccccccccccc", 80.0)):  # c's report is no training time
        store.record_timing("job", "assoc_recall/base x", seconds, 1e12, 1, 1000.0, code_version=version)
    store.record_timing("report", "removability", 900.0, 0.0, 9, 2000.0, code_version="0.0.1@cccccccccccc")
    assert main(["report", "timings", "--store", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "4 rows of other code versions" in out and "the most job time: 0.0.1@bbbbbbbbbbbb" in out


def _quoted(text: str, value: float) -> bool:
    """``text`` ("16,903", "5.07", "31.4%": a percentage of ``value``) is ``value`` at ``text``'s precision."""
    t = text.strip().rstrip("%").replace(",", "")
    decimals = len(t.split(".")[1]) if "." in t else 0
    return float(t) == round(value * (100 if text.strip().endswith("%") else 1), decimals)


def test_performance_doc_quotes_the_committed_ledger(capsys):
    """docs/PERFORMANCE.md's whole-paper figures (section 6), its where-the-time-goes table (section 7)
    and the README's are what `softprior report timings --from-bundle docs/results` computes from the
    ledger the committed bundle carries: no figure there is typed by hand."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    if not (root / "docs" / "results" / "bundle" / "ledger.json").is_file():
        pytest.skip("no committed bundle ledger")
    capsys.readouterr()
    assert main(["report", "timings", "--from-bundle", str(root / "docs" / "results"), "--code-version",
                 "0.1.0@1a7f242198ad", "--until", "2026-12-06T03:00", "--json"]) == 0
    t = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    doc = (root / "docs" / "PERFORMANCE.md").read_text()
    row = next(line for line in doc.splitlines() if "**the whole paper on this engine**" in line)
    for said in (f"**{t['wall_seconds']:,.0f} s (4 h 42 min) wall, {t['ratio']:.2f}x the floor**",
                 f"the floor** of {t['floor_seconds']:,.0f} s ({t['flop'] / 1e12:,.0f} TFLOP at {t['gemm_gflops']:.1f} GFLOP/s)",
                 f"{t['runs']} runs", f"{t['job_seconds']:,.0f} worker-seconds of jobs",
                 f"reports {t['report_seconds']:,.0f} s"):
        assert said in row, said
    assert round(t["wall_seconds"] / 60) == 4 * 60 + 42
    section = doc.split("## 7. Where the time goes")[1].split("\n\n**Base step**")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| kind")]
    shown = set()
    for kind, runs, seconds, share, gflops, x in rows:
        if kind.startswith("the other kinds"):
            continue
        head, *more = kind.split(" / ")
        kinds = [head] + [head.rsplit(" ", 1)[0] + " " + m for m in more]
        for k, cols in zip(kinds, zip(*(c.replace(" each", "").split(" / ") for c in (seconds, share, gflops, x)))):
            v = t["kinds"][k]
            assert str(v["runs"]) == runs.replace(" each", ""), k
            for text, value in zip(cols, (v["seconds"], v["share"], v["gflops"], v["x_floor"])):
                percent = text is cols[1] and not text.endswith("%")  # "6.9 / 5.2 / 2.6%": each a percentage
                assert _quoted(text + "%" if percent else text, value), (k, text)
            shown.add(k)
    other = next(r for r in rows if r[0].startswith("the other kinds"))
    rest = [v for k, v in t["kinds"].items() if k not in shown]
    assert f"{min(v['runs'] for v in rest)}-{max(v['runs'] for v in rest)} runs each" in other[0]
    for cell, f, scale, fmt in ((other[2], "seconds", 1, "{:.0f}"), (other[3], "share", 100, "{:.1f}"),
                                (other[4], "gflops", 1, "{:.0f}"), (other[5], "x_floor", 1, "{:.1f}")):
        lo, hi = min(v[f] for v in rest) * scale, max(v[f] for v in rest) * scale
        assert cell.replace(" each", "").rstrip("%") == f"{fmt.format(lo)}-{fmt.format(hi)}", (f, cell)
    readme = " ".join((root / "README.md").read_text().split())
    assert f"({t['wall_seconds']:,.0f} s, {t['runs']} runs; its {t['reports']} reports took " \
           f"{t['report_seconds']:,.0f} s, summed over their processes)" in readme
    assert f"{t['ratio']:.2f}x the arithmetic floor" in readme
