"""``softprior store verify [--repair]``: checksums recorded at write time, damage found with the run
id and file, only damaged runs re-queued, nothing else lost."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest

from conftest import state_dicts_equal, tiny_config
from softprior.cli import main
from softprior.executors.sweep import execute
from softprior.store.integrity import verify_store
from softprior.store import RunStore
from softprior.store.errors import StoreError
from softprior.training.loop import train

SNAP = "snapshots/step_0000004.safetensors"


def _configs():
    return [tiny_config(seed=0, steps=6, eval_every=3), tiny_config(seed=1, steps=6, eval_every=3),
            tiny_config(seed=2, steps=6, eval_every=3, snapshot_every=2)]  # this one has snapshots


@pytest.fixture(scope="module")
def results():
    return [train(c) for c in _configs()]


@pytest.fixture
def filled(tmp_path, results):
    """A store with three finished runs, and what each holds (to check that nothing else is lost)."""
    store = RunStore(tmp_path / "store")
    for r in results:
        store.save_result(r)
    # copies: safetensors maps the file, and the tests below damage files in place
    held = {r.config.run_id: (store.summary(r.config.run_id), store.metrics(r.config.run_id),
                              {k: v.clone() for k, v in store.load_state(r.config.run_id).items()}) for r in results}
    return store, [r.config for r in results], held


def _cli(capsys, *argv):
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _intact(store: RunStore, held: dict, except_ids=(), retrained=()):
    """Every run of ``held`` but ``except_ids`` is done with the same summary, metrics and weights
    (a ``retrained`` run's summary may differ in its wall-clock seconds only)."""
    for rid, (summary, metrics, state) in held.items():
        if rid in except_ids:
            continue
        assert store.is_done(rid), rid
        got = store.summary(rid)
        if rid in retrained:
            got, summary = {**got, "seconds": 0}, {**summary, "seconds": 0}
        assert got == summary and store.metrics(rid) == metrics
        assert state_dicts_equal(store.load_state(rid), state), rid


# ------------------------------------------------------------------ write time
def test_checksums_are_recorded_for_every_file_a_run_writes(filled):
    store, cfgs, _ = filled
    for cfg in cfgs:
        d = store.run_dir(cfg.run_id)
        on_disk = {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}
        recorded = store.file_checksums(cfg.run_id)
        assert set(recorded) == on_disk
        for name, (sha, size) in recorded.items():
            data = (d / name).read_bytes()
            assert sha == hashlib.sha256(data).hexdigest() and size == len(data), name
    assert SNAP in store.file_checksums(cfgs[2].run_id)


def test_healthy_store_says_so(filled, capsys):
    store, cfgs, _ = filled
    n_files = sum(len(store.file_checksums(c.run_id)) for c in cfgs)
    rep = verify_store(store.root)
    assert rep.healthy and rep.runs == 3 and rep.files == n_files and not rep.unverified
    rc, out, _ = _cli(capsys, "store", "verify", "--store", str(store.root))
    assert rc == 0
    assert out.strip().splitlines()[0] == (f"store {str(store.root)!r} is healthy: 3 finished runs, {n_files} files "
                                           "match the SHA-256 checksums recorded when they were written")
    assert all(line.startswith("note: the package's declaration changed") for line in out.strip().splitlines()[1:])


def test_verify_does_not_create_a_store(tmp_path, capsys):
    rc, _, err = _cli(capsys, "store", "verify", "--store", str(tmp_path / "nothing"))
    assert rc == 2 and "no run store" in err and "nothing" in err
    assert not (tmp_path / "nothing").exists()


# ------------------------------------------------------------------ damage to run files and index rows
def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_a_byte(path: Path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _damage(store: RunStore, cfg, kind: str) -> tuple[str, str]:
    """Damage one run; return (the file the report must name, words it must contain)."""
    d = store.run_dir(cfg.run_id)
    rel = f"runs/{cfg.run_id}/"
    if kind == "truncated weights":
        _truncate(d / "final.safetensors")
        return rel + "final.safetensors", "truncated"
    if kind == "truncated snapshot":
        _truncate(d / SNAP)
        return rel + SNAP, "truncated"
    if kind in ("same-size weights", "same-size snapshot"):  # other bytes, the same length: only the SHA sees it
        f = d / ("final.safetensors" if kind == "same-size weights" else SNAP)
        size = f.stat().st_size
        _flip_a_byte(f)  # a byte of tensor data: the file still loads
        assert f.stat().st_size == size
        return rel + str(f.relative_to(d)), "SHA-256 mismatch"
    if kind == "changed metrics":
        _flip_a_byte(d / "metrics.jsonl")
        return rel + "metrics.jsonl", "SHA-256 mismatch"
    if kind == "half-written directory":
        (d / "summary.json").unlink()
        (d / "final.safetensors").unlink()
        return rel + "final.safetensors", "missing"
    if kind == "damaged index row":
        with sqlite3.connect(store.root / "index.sqlite") as db:
            db.execute("UPDATE runs SET summary='{\"normal_acc\": 0.' WHERE run_id=?", (cfg.run_id,))
        return "index.sqlite", "summary is not a JSON object"
    raise ValueError(kind)


KINDS = ["truncated weights", "truncated snapshot", "same-size weights", "same-size snapshot", "changed metrics",
         "half-written directory", "damaged index row"]


@pytest.mark.parametrize("kind", KINDS)
def test_damage_is_reported_with_run_and_file_and_repair_requeues_only_that_run(filled, kind, capsys, train_calls):
    store, cfgs, held = filled
    victim = cfgs[2]  # the run with snapshots
    file, words = _damage(store, victim, kind)

    rep = verify_store(store.root)
    assert not rep.healthy and rep.damaged_runs == [victim.run_id]
    assert any(p.run_id == victim.run_id and p.file == file and words in p.what for p in rep.problems), rep.problems
    _intact(store, held, except_ids={victim.run_id})  # the other runs stay usable while it is damaged

    rc, out, _ = _cli(capsys, "store", "verify", "--store", str(store.root))
    assert rc == 1
    line = next(l for l in out.splitlines() if l.startswith("DAMAGED"))
    assert victim.run_id in line and file in line and words in line
    assert "the other 2 finished runs are intact" in out

    rc, out, _ = _cli(capsys, "store", "verify", "--repair", "--store", str(store.root))
    assert rc == 0 and "re-queued 1 damaged run" in out and "after repair: " in out and "is healthy" in out
    assert store.status(victim.run_id) is None  # its record is gone: it will be trained again
    assert not store.run_dir(victim.run_id).exists()
    moved = list((store.root / "damaged").iterdir())
    assert [m.name.split(".")[0] for m in moved] == [victim.run_id]  # files kept aside, not deleted
    _intact(store, held, except_ids={victim.run_id})

    report = execute(cfgs, store, progress=False)  # the sweep retrains only the re-queued run
    assert report.trained == 1 and report.skipped == 2
    assert [c.run_id for c, _ in train_calls] == [victim.run_id]
    _intact(store, held, retrained={victim.run_id})  # deterministic training gets back exactly what was lost
    assert verify_store(store.root).healthy


# ------------------------------------------------------------------ damage to the index file
@pytest.mark.parametrize("how", ["garbage header", "truncated"])
def test_damaged_index_is_reported_and_rebuilt_from_the_run_files(filled, how, capsys):
    store, cfgs, held = filled
    f = store.root / "index.sqlite"
    data = f.read_bytes()
    f.write_bytes(b"not a database, sorry" + data[21:] if how == "garbage header" else data[: len(data) // 3])
    also_bad = cfgs[0]
    _truncate(store.run_dir(also_bad.run_id) / "final.safetensors")  # and one run file as well

    rep = verify_store(store.root)
    assert rep.index_damaged and not rep.healthy
    assert any(p.run_id is None and p.file == "index.sqlite" for p in rep.problems)
    with pytest.raises(StoreError):
        RunStore(store.root)  # the store cannot be used until it is repaired

    rc, out, _ = _cli(capsys, "store", "verify", "--store", str(store.root))
    assert rc == 1 and "DAMAGED index: index.sqlite" in out and "--repair" in out

    rc, out, _ = _cli(capsys, "store", "verify", "--repair", "--store", str(store.root))
    assert rc == 0 and "index rebuilt" in out and "after repair: " in out and "is healthy" in out
    assert len(list(store.root.glob("index.sqlite.damaged.*"))) >= 1  # the old index is kept
    fresh = RunStore(store.root)
    _intact(fresh, held, except_ids={also_bad.run_id})  # every intact run is back, unchanged
    assert fresh.status(also_bad.run_id) is None  # the damaged one is re-queued
    for c in cfgs[1:]:  # with its checksums recorded again
        assert set(fresh.file_checksums(c.run_id)) >= {"config.json", "metrics.jsonl", "final.safetensors",
                                                       "summary.json"}
    assert verify_store(store.root).healthy


# ------------------------------------------------------------------ stores from before checksums, unfinished runs
def test_runs_without_recorded_checksums_are_checked_for_readability(filled, capsys):
    store, cfgs, held = filled
    with sqlite3.connect(store.root / "index.sqlite") as db:
        db.execute("DELETE FROM files")  # as a store written before checksums were recorded
    rep = verify_store(store.root)
    assert rep.healthy and sorted(rep.unverified) == sorted(c.run_id for c in cfgs) and rep.files == 0
    rc, out, _ = _cli(capsys, "store", "verify", "--store", str(store.root))
    assert rc == 0 and "no recorded checksums" in out
    _truncate(store.run_dir(cfgs[1].run_id) / "final.safetensors")
    rep = verify_store(store.root)
    assert rep.damaged_runs == [cfgs[1].run_id]
    assert rep.problems[0].file == f"runs/{cfgs[1].run_id}/final.safetensors" and "unreadable" in rep.problems[0].what


def test_unfinished_run_directories_are_listed_not_damaged(filled, capsys):
    store, cfgs, _ = filled
    d = store.run_dir("0123456789abcdef")
    d.mkdir()
    (d / "config.json").write_text("{}")  # a run killed before it was committed
    rep = verify_store(store.root)
    assert rep.healthy and rep.unfinished == ["0123456789abcdef"]
    rc, out, _ = _cli(capsys, "store", "verify", "--repair", "--store", str(store.root))
    assert rc == 0 and "0123456789abcdef" in out and d.exists()  # nothing to repair, nothing moved


def test_rebuild_reindexes_a_run_whose_checksum_rows_alone_were_lost(filled):
    """Checksum rows lost with a damaged index are the index's damage: the run's intact files are read
    instead, and the run is indexed again (not moved aside and retrained)."""
    from softprior.store.integrity import _read_index, _rebuild_index
    store, cfgs, held = filled
    victim = cfgs[1].run_id
    _, sums, _, _ = _read_index(store.root / "index.sqlite")
    del sums[victim]["metrics.jsonl"]  # as if that row went down with the index
    requeued, indexed = _rebuild_index(store.root, sums, "test")
    assert requeued == [] and indexed == 3 and not (store.root / "damaged").exists()
    fresh = RunStore(store.root)
    _intact(fresh, held)
    assert "metrics.jsonl" in fresh.file_checksums(victim)  # recorded again from the file
    assert verify_store(store.root).healthy


def test_rebuild_carries_the_time_ledger_over(filled, capsys):
    """A damaged index whose time ledger can still be read (here its runs table is gone): `store verify
    --repair` rebuilds it and appends those ledger rows as they were (kind, times, FLOP, detail, order),
    so a repaired store's `report timings` still counts the work it holds."""
    from softprior.store.integrity import _read_ledger
    store, cfgs, held = filled
    store.index.record_timing("job", "a job", 20.0, flop=3e12, runs=2, code_version="v", gemm_gflops=300.0)
    with sqlite3.connect(store.root / "index.sqlite") as db:  # a row that names no host (an older index)
        db.execute("INSERT INTO ledger(kind, name, seconds, flop, runs, started_at, host, code_version, gemm_gflops,"
                   " detail, created) VALUES('report', 'by hand', 1.5, 0, 0, 121.5, NULL, NULL, NULL, ?, 123.0)",
                   (json.dumps({"x": [1, 2]}),))
    before = store.ledger()
    assert [r["name"] for r in before] == ["a job", "by hand"] and before[0]["host"] and before[1]["host"] is None
    with sqlite3.connect(store.root / "index.sqlite") as db:
        db.execute("DROP TABLE runs")
    assert verify_store(store.root).index_damaged
    rc, out, _ = _cli(capsys, "store", "verify", "--repair", "--store", str(store.root))
    assert rc == 0 and "index rebuilt" in out and "is healthy" in out
    fresh = RunStore(store.root)
    _intact(fresh, held)
    after = fresh.ledger()
    assert [{k: v for k, v in r.items() if k != "id"} for r in after] == \
        [{k: v for k, v in r.items() if k != "id"} for r in before]
    assert after[-1]["created"] == 123.0 and after[-1]["detail"] == {"x": [1, 2]}
    assert after[-1]["host"] is None  # not the repairing machine's name
    assert _read_ledger(store.root / "no such index.sqlite") == []


# ------------------------------------------------------------------ everything the store owns (issue 28)
def _forget_checksum(store: RunStore, run_id: str, name: str):
    with sqlite3.connect(store.root / "index.sqlite") as db:
        db.execute("DELETE FROM files WHERE run_id=? AND name=?", (run_id, name))


@pytest.mark.parametrize("truncated", [True, False])
def test_a_snapshot_without_a_checksum_row_is_reported(filled, truncated, capsys):
    store, cfgs, held = filled
    victim = cfgs[2]
    _forget_checksum(store, victim.run_id, SNAP)
    if truncated:
        _truncate(store.run_dir(victim.run_id) / SNAP)
        with pytest.raises(StoreError):
            store.load_snapshots(victim.run_id)  # what a report would meet
    rep = verify_store(store.root)
    assert not rep.healthy and rep.damaged_runs == [victim.run_id]
    (p,) = rep.problems
    assert p.file == f"runs/{victim.run_id}/{SNAP}" and "no checksum recorded" in p.what
    assert ("unreadable" in p.what) == truncated
    rc, out, _ = _cli(capsys, "store", "verify", "--repair", "--store", str(store.root))
    assert rc == 0 and "re-queued 1 damaged run" in out and store.status(victim.run_id) is None
    _intact(store, held, except_ids={victim.run_id})


def test_a_config_that_does_not_hash_to_its_run_id_is_reported(filled):
    store, cfgs, _ = filled
    victim, other = cfgs[0], cfgs[1]
    f = store.run_dir(victim.run_id) / "config.json"
    f.write_bytes((store.run_dir(other.run_id) / "config.json").read_bytes())  # another run's config ...
    sha = hashlib.sha256(f.read_bytes()).hexdigest()
    with sqlite3.connect(store.root / "index.sqlite") as db:  # ... with its checksum row rewritten to match
        db.execute("UPDATE files SET sha256=?, size=? WHERE run_id=? AND name='config.json'",
                   (sha, f.stat().st_size, victim.run_id))
    rep = verify_store(store.root)
    assert rep.damaged_runs == [victim.run_id]
    (p,) = rep.problems
    assert p.file == f"runs/{victim.run_id}/config.json" and "does not hash to the run id" in p.what


def _record_for(cfg, **over):
    from softprior.preregistration import calibration_key
    from softprior.calibration.register import make_record
    from softprior.calibration.space import load_space
    rec = make_record(load_space("tiny"), {"n_pairs": 4}, {}, [calibration_key(cfg)], {}, True)
    return {**rec, **over}


def test_every_calibration_record_is_verified(filled, capsys):
    import json
    store, cfgs, held = filled
    forged = store.root / "calibration" / "assoc_recall-forged.json"
    forged.parent.mkdir()
    forged.write_text(json.dumps(_record_for(cfgs[0], measured={"made": "up"})))  # its hash is not its content's
    rep = verify_store(store.root)
    assert not rep.healthy and rep.damaged_runs == [] and rep.refused_records == ["calibration/assoc_recall-forged.json"]
    from softprior.preregistration import all_shipped_records
    assert rep.records == len(all_shipped_records()) + 1 and "forged or edited" in rep.problems[0].what  # and this one
    rc, out, _ = _cli(capsys, "store", "verify", "--store", str(store.root))
    assert rc == 1 and "DAMAGED record: calibration/assoc_recall-forged.json: calibration record refused" in out
    rc, out, _ = _cli(capsys, "store", "verify", "--repair", "--store", str(store.root))
    assert rc == 0 and "moved 1 refused calibration record" in out and "is healthy" in out
    assert not forged.exists() and len(list((store.root / "damaged" / "calibration").iterdir())) == 1
    _intact(store, held)


def test_a_record_added_after_its_rows_and_a_run_under_an_unknown_record_are_reported(filled):
    import json
    store, cfgs, held = filled
    row = tiny_config(path="fade10", steps=6, eval_every=3, task_options={"n_pairs": 4})  # a prediction row
    execute([row], store, progress=False, require_calibration=False)  # exploratory: under no record
    late = _record_for(row, registered_at="2020-01-01T00:00:00Z")  # back-dated, and hashed to match
    body = json.dumps({k: v for k, v in late.items() if k != "hash"}, sort_keys=True, separators=(",", ":"))
    late["hash"] = hashlib.sha256(body.encode()).hexdigest()[:16]  # (hash scheme v2: all but the hash)
    f = store.root / "calibration" / f"assoc_recall-{late['hash']}.json"
    f.parent.mkdir()
    f.write_text(json.dumps(late))
    rep = verify_store(store.root)
    (p,) = rep.problems
    assert p.run_id is None and p.file == f"calibration/{f.name}" and row.run_id in p.what and "after the fact" in p.what
    f.unlink()
    # a finished run whose index row names a record no one holds
    with sqlite3.connect(store.root / "index.sqlite") as db:
        db.execute("UPDATE runs SET record=? WHERE run_id=?", ("f" * 16, cfgs[1].run_id))
    rep = verify_store(store.root)
    assert rep.damaged_runs == [cfgs[1].run_id] and "neither the store nor the package holds" in rep.problems[0].what
