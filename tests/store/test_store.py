"""The run store: files, caching, errors, checkpoint/resume."""

from __future__ import annotations

import copy
import json
import os
import pickle
import socket
import struct
import subprocess
import sys

import pandas as pd
import pytest
import torch
from safetensors import safe_open

import softprior.executors.sweep as sweep_mod
from conftest import patch_train, state_dicts_equal, tiny_config
from softprior.paths import GateConfig, PathConfig
from softprior.schedules import Fade
from softprior.store import RunStore, load_results
from softprior.store.errors import RunNotFoundError, StoreError
from softprior.training.loop import train

FILES = {"config.json", "metrics.jsonl", "final.safetensors", "summary.json"}


@pytest.fixture
def done_run(store):
    """(store, cfg, RunResult) for one finished tiny run saved in the store."""
    cfg = tiny_config()
    result = train(cfg)
    store.save_result(result)
    return store, cfg, result


@pytest.fixture
def no_pickle(monkeypatch):
    """Fail loudly if anything unpickles."""
    def boom(*a, **k):
        raise AssertionError("the store must never unpickle")
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(torch, "load", boom)


# ------------------------------------------------------------------ round trip
def test_save_load_round_trip(done_run):
    store, cfg, result = done_run
    rid = cfg.run_id
    assert store.is_done(rid) and store.status(rid) == "done"
    assert store.summary(rid) == result.summary
    assert store.metrics(rid) == result.metrics
    assert store.load_config(rid) == cfg
    assert state_dicts_equal(store.load_state(rid), result.state_dict)
    cfg2, model = store.load_model(rid)
    assert cfg2 == cfg and not model.training
    assert state_dicts_equal({k: v for k, v in model.state_dict().items()}, result.state_dict)
    # a unique prefix of the run id is accepted
    assert store.summary(rid[:6]) == result.summary


def test_store_survives_reopening(done_run, tmp_path):
    store, cfg, result = done_run
    again = RunStore(store.root)
    assert again.is_done(cfg.run_id)
    assert state_dicts_equal(again.load_state(cfg.run_id), result.state_dict)


def test_files_are_safetensors_and_json(done_run, no_pickle):
    store, cfg, result = done_run
    d = store.run_dir(cfg.run_id)
    names = {p.name for p in d.iterdir()}
    assert FILES <= names
    assert "checkpoint.safetensors" not in names
    assert not [n for n in names if n.endswith(".tmp")]
    assert json.loads((d / "config.json").read_text())["seed"] == cfg.seed
    assert json.loads((d / "summary.json").read_text())["run_id"] == cfg.run_id
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20]
    raw = (d / "final.safetensors").read_bytes()
    assert not raw.startswith((b"PK", b"\x80"))  # neither a torch zip archive nor a pickle
    (n,) = struct.unpack("<Q", raw[:8])  # safetensors: u64 header length, then a JSON header
    header = json.loads(raw[8:8 + n])
    assert set(header) - {"__metadata__"} == set(result.state_dict)
    with safe_open(str(d / "final.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(result.state_dict)
        for k in f.keys():
            assert torch.equal(f.get_tensor(k), result.state_dict[k])


def test_load_results_dataframe(store):
    cfgs = [tiny_config(seed=0), tiny_config(seed=1), tiny_config(path="forced_zero")]
    summaries = [sweep_mod.run(c, store) for c in cfgs]
    df = load_results(store)
    assert isinstance(df, pd.DataFrame)
    assert len(df) == 3
    assert set(df["run_id"]) == {c.run_id for c in cfgs}
    by_id = df.set_index("run_id")
    for c, s in zip(cfgs, summaries):
        assert by_id.loc[c.run_id, "normal_acc"] == s["normal_acc"]
        assert by_id.loc[c.run_id, "zero_acc"] == s["zero_acc"]
        assert by_id.loc[c.run_id, "seed"] == c.seed
    # a path to the store works as well as a RunStore
    assert len(load_results(str(store.root))) == 3


def test_load_results_empty_store(store):
    df = load_results(store)
    assert isinstance(df, pd.DataFrame) and len(df) == 0


# ------------------------------------------------------------------ caching
def test_done_run_is_not_retrained(store, train_calls):
    cfg = tiny_config()
    first = sweep_mod.run(cfg, store)
    second = sweep_mod.run(cfg, store)
    assert len(train_calls) == 1
    assert second == first
    # a new store object on the same directory sees it too
    sweep_mod.run(cfg, RunStore(store.root))
    assert len(train_calls) == 1


def test_non_semantic_fields_share_the_run(store, train_calls):
    sweep_mod.run(tiny_config(label="first"), store)
    sweep_mod.run(tiny_config(label="second", checkpoint_every=5), store)
    assert len(train_calls) == 1
    sweep_mod.run(tiny_config(seed=1), store)
    assert len(train_calls) == 2


def test_failed_run_is_recorded_and_retried(store, monkeypatch):
    cfg = tiny_config()

    def broken(cfg, *a, **kw):
        raise RuntimeError("simulated crash")

    patch_train(monkeypatch, broken)
    with pytest.raises(RuntimeError, match="simulated crash"):
        sweep_mod.run(cfg, store)
    assert store.status(cfg.run_id) == "failed"
    with pytest.raises(RunNotFoundError):
        store.summary(cfg.run_id)
    monkeypatch.undo()
    sweep_mod.run(cfg, store)
    assert store.is_done(cfg.run_id)


def test_claims(store):
    cfg = tiny_config()
    other = RunStore(store.root)
    other.owner = "another-host:1"  # a live claim held elsewhere
    assert other.claim(cfg)
    assert store.status(cfg.run_id) == "running"
    assert not store.claim(cfg)
    assert other.claim(cfg)  # the owner may re-claim its own run


def test_claim_of_a_dead_local_process_is_taken_over(store, train_calls):
    cfg = tiny_config()
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead = RunStore(store.root)
    dead.owner = f"{socket.gethostname()}:{p.pid}"  # a process of this host that has exited
    assert dead.claim(cfg)
    sweep_mod.run(cfg, store)
    assert store.is_done(cfg.run_id) and len(train_calls) == 1


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("method", ["summary", "load_state", "load_config", "metrics", "load_model"])
def test_unknown_run_id(store, method):
    with pytest.raises(RunNotFoundError) as ei:
        getattr(store, method)("deadbeefdeadbeef")
    assert "deadbeefdeadbeef" in str(ei.value)


# Regression: run-id lookup uses SQL LIKE without escaping, so '%'
# and '_' act as wildcards: store.summary('%') returns an arbitrary run instead of RunNotFoundError
def test_run_id_wildcards_are_not_patterns(done_run):
    store, cfg, _ = done_run
    for pattern in ("%", "_" * 16, cfg.run_id[:3] + "%", ""):
        with pytest.raises(RunNotFoundError):
            store.summary(pattern)


def test_run_not_done_is_not_loadable(store):
    cfg = tiny_config()
    assert store.claim(cfg)
    assert store.status(cfg.run_id) == "running"
    with pytest.raises(RunNotFoundError):
        store.summary(cfg.run_id)
    with pytest.raises(RunNotFoundError):
        store.load_state(cfg.run_id)


def _corruptions(good: bytes, tmp_path):
    buf = tmp_path / "pickled.pt"
    torch.save({"x": torch.zeros(3)}, buf)
    return {
        "garbage": os.urandom(256),
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "bad_header": struct.pack("<Q", 20) + b"{not json at all....",
        "torch_pickle": buf.read_bytes(),
        "raw_pickle": pickle.dumps({"x": [1, 2, 3]}),
    }


def test_corrupt_final_weights_raise_store_error(done_run, tmp_path, no_pickle):
    store, cfg, _ = done_run
    f = store.run_dir(cfg.run_id) / "final.safetensors"
    cases = _corruptions(f.read_bytes(), tmp_path)  # (torch.save / pickle.dumps only write)
    for name, data in cases.items():
        f.write_bytes(data)
        with pytest.raises(StoreError):
            store.load_state(cfg.run_id)
        with pytest.raises(StoreError):
            store.load_model(cfg.run_id)
    f.unlink()
    with pytest.raises(StoreError):
        store.load_state(cfg.run_id)


def test_weights_not_matching_config_raise_store_error(done_run):
    store, cfg, result = done_run
    from safetensors.torch import save_file
    bad = dict(result.state_dict)
    bad.pop("ln_final.weight")
    save_file({k: v.contiguous() for k, v in bad.items()}, str(store.run_dir(cfg.run_id) / "final.safetensors"))
    with pytest.raises(StoreError):
        store.load_model(cfg.run_id)


def test_corrupt_config_raises_store_error(done_run):
    store, cfg, _ = done_run
    (store.run_dir(cfg.run_id) / "config.json").write_text("{ nope")
    with pytest.raises(StoreError):
        store.load_config(cfg.run_id)


def test_unwritable_store_directory(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError) as ei:
        RunStore(blocker / "store")
    assert "a_file" in str(ei.value)
    with pytest.raises(StoreError):
        RunStore(blocker)  # the root itself is a file


def test_corrupt_index_raises_store_error(tmp_path):
    root = tmp_path / "store"
    (root / "runs").mkdir(parents=True)
    (root / "index.sqlite").write_bytes(b"this is not an sqlite database" * 100)
    with pytest.raises(StoreError):
        RunStore(root)


def test_an_unreadable_run_points_at_store_verify(done_run):
    """It used to say "checkpoint does not match its config", which names no way out."""
    from softprior.store.errors import StoreDamagedError
    store, cfg, _ = done_run
    (store.run_dir(cfg.run_id) / "final.safetensors").write_bytes(b"not weights")
    for call in (store.load_model, store.load_state):
        with pytest.raises(StoreDamagedError, match=r"`softprior store verify --store .*` checks every run"):
            call(cfg.run_id)


def test_a_store_opened_read_only_is_read_and_never_written(done_run, tmp_path):
    """``read_only=True`` (the commands that only read): no store is created, every write refuses."""
    from softprior.store.errors import StoreNotFoundError, StoreReadOnlyError
    with pytest.raises(StoreNotFoundError, match="check --store"):
        RunStore(tmp_path / "typo", read_only=True)
    assert not (tmp_path / "typo").exists()
    store, cfg, result = done_run
    ro = RunStore(store.root, read_only=True)
    assert ro.read_only and not store.read_only
    assert ro.summary(cfg.run_id) == store.summary(cfg.run_id) and ro.rows() == store.rows()
    assert state_dicts_equal(ro.load_state(cfg.run_id), result.state_dict)
    other = tiny_config(seed=1)
    for write in (lambda: ro.claim(other), lambda: ro.record_failure(other, "x"), lambda: ro.forget([cfg.run_id]),
                  lambda: ro.heartbeat(), lambda: ro.save_checkpoint(other.run_id, {"tensors": {}, "meta": {}}),
                  lambda: ro.save_result(result), lambda: ro.files.drop_checkpoint(cfg.run_id)):
        with pytest.raises(StoreReadOnlyError, match="open read-only"):
            write()
    assert ro.write_cache("x.csv", b"1") == store.root / "analysis_cache" / "x.csv"  # a cache, where it can be
    assert store.is_done(cfg.run_id) and store.status(other.run_id) is None


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_store_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(StoreError):
            RunStore(ro / "store")
    finally:
        ro.chmod(0o700)


# ------------------------------------------------------------------ checkpoint and resume
def _fade_path():
    fade = GateConfig(mode="scheduled", schedule=Fade(start_step=5, width=10))
    return PathConfig(name="test_fade5", pos=fade, content=fade)


RESUME_PATHS = {"unforced": "unforced", "prior_dropout0.5": "prior_dropout0.5", "fade5": _fade_path()}


@pytest.mark.parametrize("path", sorted(RESUME_PATHS))
def test_checkpoint_resume_is_bit_identical(path):
    # eval every 4, checkpoint every 10: the checkpoint falls inside an evaluation window
    cfg = tiny_config(path=RESUME_PATHS[path], eval_every=4, checkpoint_every=10)
    ckpts = []
    full = train(cfg, on_checkpoint=lambda c: ckpts.append(copy.deepcopy(c)))
    assert [c["meta"]["step"] for c in ckpts] == [10]
    resumed = train(cfg, resume=ckpts[0])
    assert resumed.metrics == full.metrics
    assert state_dicts_equal(resumed.state_dict, full.state_dict)
    for k in ("normal_acc", "zero_acc", "normal_loss", "zero_loss"):
        assert resumed.summary[k] == full.summary[k]


def test_checkpoint_every_and_final_step():
    cfg = tiny_config(checkpoint_every=5)
    ckpts = []
    train(cfg, on_checkpoint=lambda c: ckpts.append(c["meta"]["step"]))
    assert ckpts == [5, 10, 15]  # none at the final step: the result itself is saved then


# Regression: train() puts its live `metrics` list into the
# checkpoint dict passed to on_checkpoint (meta['metrics'] is not copied), so a kept checkpoint keeps
# growing and resuming from it duplicates the later metrics rows
def test_checkpoint_dict_is_a_snapshot():
    cfg = tiny_config(eval_every=4, checkpoint_every=10)
    ckpts = []
    full = train(cfg, on_checkpoint=ckpts.append)
    assert [r["step"] for r in ckpts[0]["meta"]["metrics"][0]] == [4, 8]  # one list of rows per run (K = 1)
    assert train(cfg, resume=ckpts[0]).metrics == full.metrics


def test_checkpoint_snapshots_are_a_snapshot():
    cfg = tiny_config(eval_every=4, checkpoint_every=10, snapshot_every=5)
    ckpts = []
    full = train(cfg, on_checkpoint=ckpts.append)
    assert [st for st, _ in full.snapshots] == [0, 5, 10, 15, 20]
    assert [st for st, _ in ckpts[0].get("snapshots", [])] == [0, 5, 10]
    resumed = train(cfg, resume=ckpts[0])
    assert [st for st, _ in resumed.snapshots] == [0, 5, 10, 15, 20]
    assert all(state_dicts_equal(a, b) for (_, a), (_, b) in zip(resumed.snapshots, full.snapshots))


def test_checkpoint_round_trips_through_store(store):
    cfg = tiny_config(path="prior_dropout0.5", eval_every=4, checkpoint_every=10)
    full = train(cfg, on_checkpoint=lambda c: store.save_checkpoint(cfg.run_id, c))  # saved as it is made
    f = store.run_dir(cfg.run_id) / "checkpoint.safetensors"
    assert f.is_file() and not f.read_bytes().startswith((b"PK", b"\x80"))
    loaded = store.load_checkpoint(cfg.run_id)
    assert loaded["meta"]["step"] == 10
    resumed = train(cfg, resume=loaded)
    assert resumed.metrics == full.metrics
    assert state_dicts_equal(resumed.state_dict, full.state_dict)


def test_the_sweep_driver_resumes_a_killed_run(tmp_path, train_calls):
    cfg = tiny_config(eval_every=4, checkpoint_every=10)
    ref_store = RunStore(tmp_path / "ref")
    ckpts = []
    full = train(cfg, on_checkpoint=lambda c: ckpts.append(copy.deepcopy(c)))

    # a run that was killed after its step-10 checkpoint: claimed, checkpoint on disk, not done
    st = RunStore(tmp_path / "killed")
    assert st.claim(cfg)
    st.save_checkpoint(cfg.run_id, ckpts[0])
    sweep_mod.run(cfg, st)
    (resume_cfg, kw), = train_calls
    assert kw["resume"] is not None and kw["resume"]["meta"]["step"] == 10
    assert st.metrics(cfg.run_id) == full.metrics
    assert state_dicts_equal(st.load_state(cfg.run_id), full.state_dict)
    assert not (st.run_dir(cfg.run_id) / "checkpoint.safetensors").exists()
    # and an uninterrupted run through the sweep driver writes checkpoints and gets the same numbers
    sweep_mod.run(cfg, ref_store)
    assert ref_store.metrics(cfg.run_id) == full.metrics


def test_corrupt_checkpoint_restarts_from_scratch(store, train_calls):
    cfg = tiny_config(checkpoint_every=10)
    full = train(cfg)
    assert store.claim(cfg)
    d = store.run_dir(cfg.run_id)
    d.mkdir(parents=True, exist_ok=True)
    (d / "checkpoint.safetensors").write_bytes(b"\x00" * 100)
    sweep_mod.run(cfg, store)
    assert train_calls[0][1]["resume"] is None
    assert state_dicts_equal(store.load_state(cfg.run_id), full.state_dict)


def test_a_live_local_owner_keeps_its_claim_however_old_its_heartbeat(tmp_path):
    """A sweep that runs for hours keeps the runs it queued; only a dead owner's claim is taken over."""
    import socket
    import sqlite3
    from softprior.config import make_run_config
    from softprior.store import RunStore
    cfg = make_run_config("assoc_recall", "unforced", 0, steps=4, calibrated=False)
    a, b = RunStore(tmp_path), RunStore(tmp_path)
    b.owner = f"{socket.gethostname()}:{os.getpid()}-other"  # not a pid: treated as alive
    a.owner = f"{socket.gethostname()}:{os.getpid()}"
    assert a.claim(cfg)
    with sqlite3.connect(tmp_path / "index.sqlite") as db:
        db.execute("UPDATE runs SET heartbeat=0 WHERE run_id=?", (cfg.run_id,))  # hours ago
    assert not b.claim(cfg)
    a.record_failure(cfg, "x")  # failures never overwrite a finished run (and a failed run is claimable)
    assert b.claim(cfg)


def test_a_failure_record_never_overwrites_a_finished_run(tmp_path):
    from softprior.config import make_run_config
    from softprior.store import RunStore
    from softprior.training.loop import train
    cfg = make_run_config("assoc_recall", "unforced", 0, steps=4, eval_every=2, n_val=16, calibrated=False)
    s = RunStore(tmp_path)
    assert s.claim(cfg)
    s.save_result(train(cfg))
    s.record_failure(cfg, "parent run is not available")  # e.g. written by another sweep meanwhile
    assert s.is_done(cfg.run_id) and s.summary(cfg.run_id)["run_id"] == cfg.run_id


def test_a_sweep_heartbeats_every_claim_it_holds(tmp_path):
    """``heartbeat()`` refreshes every run this process holds (a sweep calls it as jobs finish), so
    a sweep that outlives the 6 h lease keeps its queued runs; others' claims are not touched."""
    import sqlite3
    from softprior.config import make_run_config
    from softprior.store import RunStore
    cfgs = [make_run_config("assoc_recall", "unforced", s, steps=4, calibrated=False) for s in range(3)]
    a, b = RunStore(tmp_path), RunStore(tmp_path)
    b.owner = "another-host:1"
    assert a.claim(cfgs[0]) and a.claim(cfgs[1]) and b.claim(cfgs[2])
    with sqlite3.connect(tmp_path / "index.sqlite") as db:
        db.execute("UPDATE runs SET heartbeat=0")
    a.heartbeat()
    with sqlite3.connect(tmp_path / "index.sqlite") as db:
        beats = dict(db.execute("SELECT run_id, heartbeat FROM runs").fetchall())
    assert beats[cfgs[0].run_id] > 0 and beats[cfgs[1].run_id] > 0 and beats[cfgs[2].run_id] == 0


def test_an_older_single_run_checkpoint_restarts_the_run_without_its_snapshots(store):
    # before loop.train was the K = 1 loop, a single run's checkpoint had no run ids: such a file (and
    # the snapshots it kept) is dropped and the run starts again, rather than mixing two loops' weights
    from safetensors.torch import save_file
    cfg = tiny_config()
    d = store.run_dir(cfg.run_id)
    (d / "snapshots").mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(d / "snapshots" / "step_0000005.safetensors"), {"step": "5"})
    save_file({"model.w": torch.zeros(2)}, str(d / "checkpoint.safetensors"),
              {"meta": json.dumps({"step": 5, "n_in_window": 0, "metrics": []})})
    assert store.load_checkpoint(cfg.run_id) is None
    assert not (d / "checkpoint.safetensors").exists() and not (d / "snapshots").exists()


def _open_new_store(root, barrier, errors):
    barrier.wait()
    try:
        RunStore(root).index.record_timing("job", "opened", 0.0)
    except Exception as e:  # noqa: BLE001 - the test reports it
        errors.put(repr(e))


def test_processes_that_create_one_store_at_once_all_open_it(tmp_path):
    """Several processes opening a store that does not exist yet, at the same moment (two sweeps started
    together): each one opens it. SQLite refused the others' switch of the new file to WAL mode at once,
    "database is locked", before the index retried it."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    errors, rows = ctx.Queue(), 0
    for trial in range(12):
        root = tmp_path / f"s{trial}"
        barrier = ctx.Barrier(4)
        procs = [ctx.Process(target=_open_new_store, args=(root, barrier, errors)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert all(p.exitcode == 0 for p in procs)
        rows += len(RunStore(root).index.ledger())
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found, found
    assert rows == 12 * 4
