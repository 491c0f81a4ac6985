"""Sweeps: kill and resume, failures, concurrent sweeps on one store, and Ray against local."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from softprior.executors.sweep import execute
from softprior.experiments import Options, get_experiment
from softprior.reports.experiment import aggregate, collect
from softprior.store import RunStore

from conftest import record_progress, tiny_config

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "softprior.cli", *args]


def _done_count(store_dir: Path) -> int:
    if not (store_dir / "index.sqlite").exists():
        return 0
    try:
        return sum(r["status"] == "done" for r in RunStore(store_dir).rows())
    except Exception:  # the index may be mid-creation
        return 0


def _trained(stderr: str) -> int:
    line = next(l for l in stderr.splitlines() if " trained, " in l)
    return int(line.split(" trained, ")[0].rsplit(" ", 1)[1])


def test_reproduce_survives_sigkill_and_resumes_only_missing_runs(tmp_path):
    """Kill `reproduce paths --quick` partway; the re-run trains only what is missing and the final
    table equals an uninterrupted sweep's."""
    killed_store, clean_store = tmp_path / "killed", tmp_path / "clean"
    p = subprocess.Popen(_cli("reproduce", "paths", "--quick", "--store", str(killed_store), "--out",
                              str(tmp_path / "out_killed"), "--no-progress"), env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while _done_count(killed_store) < 3 and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert p.poll() is None, "the sweep finished before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    done_before = _done_count(killed_store)
    total = len(get_experiment("paths").build(Options(quick=True)))
    assert 3 <= done_before < total

    again = subprocess.run(_cli("reproduce", "paths", "--quick", "--store", str(killed_store), "--out",
                                str(tmp_path / "out_killed"), "--no-progress"), env=ENV, capture_output=True,
                           text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _trained(again.stderr) == total - done_before

    clean = subprocess.run(_cli("reproduce", "paths", "--quick", "--store", str(clean_store), "--out",
                                str(tmp_path / "out_clean"), "--no-progress"), env=ENV, capture_output=True,
                           text=True, timeout=900)
    assert clean.returncode == 0, clean.stderr[-2000:]
    assert _trained(clean.stderr) == total
    def numbers(f):  # the provenance line names the commit, which may move while a developer runs this
        text = (tmp_path / f / "table.md").read_text()
        assert "_Provenance of these" in text
        return [line for line in text.splitlines() if not line.startswith("_Provenance of these")]
    assert (tmp_path / "out_killed" / "table.csv").read_text() == (tmp_path / "out_clean" / "table.csv").read_text()
    assert numbers("out_killed") == numbers("out_clean")
    assert (tmp_path / "out_killed" / "figure.png").stat().st_size > 1000


def test_single_run_killed_mid_training_resumes_bit_identically(tmp_path):
    args = ["train", "--task", "assoc_recall", "--path", "fade600", "--seed", "1", "--steps", "300",
            "--checkpoint-every", "40", "--json", "--no-progress"]
    killed = tmp_path / "killed"
    p = subprocess.Popen(_cli(*args, "--store", str(killed)), env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    ckpt = None
    while time.time() < deadline and p.poll() is None:
        found = list(killed.glob("runs/*/checkpoint.safetensors"))
        if found:
            meta = RunStore(killed).load_checkpoint(found[0].parent.name)
            if meta is not None and meta["meta"]["step"] >= 80:
                ckpt = meta["meta"]["step"]
                break
        time.sleep(0.1)
    assert p.poll() is None and ckpt is not None, "the run finished before a checkpoint was seen"
    p.send_signal(signal.SIGKILL)
    p.wait()
    resumed = subprocess.run(_cli(*args, "--store", str(killed)), env=ENV, capture_output=True, text=True, timeout=600)
    clean = subprocess.run(_cli(*args, "--store", str(tmp_path / "clean")), env=ENV, capture_output=True, text=True,
                           timeout=600)
    assert resumed.returncode == 0 and clean.returncode == 0, resumed.stderr[-2000:] + clean.stderr[-2000:]
    a, b = json.loads(resumed.stdout.splitlines()[-1]), json.loads(clean.stdout.splitlines()[-1])
    for k in ("normal_acc", "zero_acc", "normal_loss", "zero_loss", "run_id"):
        assert a[k] == b[k], k
    rid = a["run_id"]
    ka, kb = RunStore(killed), RunStore(tmp_path / "clean")
    assert ka.metrics(rid) == kb.metrics(rid)
    sa, sb = ka.load_state(rid), kb.load_state(rid)
    assert all((sa[k] == sb[k]).all() for k in sa)


def test_a_failing_run_is_recorded_and_the_sweep_goes_on(tmp_path):
    store = RunStore(tmp_path / "s")
    good = [tiny_config(seed=s) for s in range(2)]
    bad = tiny_config(seed=9, lr=1e30, grad_clip=None)  # diverges: NaN loss
    report = execute([good[0], bad, good[1]], store, progress=False)
    assert report.trained == 2
    assert [rid for rid, _ in report.failed] == [bad.run_id]
    assert "non-finite" in report.failed[0][1]
    assert store.status(bad.run_id) == "failed" and all(store.is_done(c.run_id) for c in good)
    assert "1 failed" in report.line()


def test_failing_run_inside_a_group_does_not_spoil_the_others(tmp_path, monkeypatch):
    store = RunStore(tmp_path / "s")
    cfgs = [tiny_config(seed=0), tiny_config(seed=1, grad_clip=None), tiny_config(seed=2)]
    # same group key, but the group engine raises: the driver falls back to single runs
    import softprior.training.engine as engine

    def boom(cfgs_, **kw):
        raise RuntimeError("group failure")
    monkeypatch.setattr(engine, "train_group", boom)
    report = execute(cfgs, store, group_size=3, progress=False)
    assert report.trained == 3 and not report.failed


def test_group_engine_exception_is_recorded_with_traceback_before_the_fallback(tmp_path, monkeypatch, capsys):
    """The engine's exception used to be swallowed (the runs were silently retrained one by one)."""
    import softprior.training.engine as engine
    from conftest import patch_train

    store = RunStore(tmp_path / "s")
    cfgs = [tiny_config(seed=s, steps=5) for s in range(3)]

    def exploding_group_engine(cfgs_, **kw):
        raise ZeroDivisionError("stacked step went wrong")
    monkeypatch.setattr(engine, "train_group", exploding_group_engine)
    errors_seen_by_fallback = []

    def single(cfg, *a, **kw):  # the fallback's single runs: the error must already be in the store
        errors_seen_by_fallback.append(len(store.engine_errors()))
        return orig(cfg, *a, **kw)
    orig = patch_train(monkeypatch, single)

    report = execute(cfgs, store, group_size=3, progress=False)
    assert report.trained == 3 and not report.failed
    assert errors_seen_by_fallback == [1, 1, 1]
    (rec,) = store.engine_errors()
    assert rec["run_ids"] == [c.run_id for c in cfgs]
    assert rec["error"].startswith("ZeroDivisionError: stacked step went wrong")
    assert "Traceback (most recent call last)" in rec["error"] and "exploding_group_engine" in rec["error"]
    # the sweep summary reports it
    assert report.engine_errors == [([c.run_id for c in cfgs], rec["error"])]
    line = report.line()
    assert "1 group engine error" in line and "ENGINE ERROR in a group of 3 runs" in line
    assert "ZeroDivisionError: stacked step went wrong" in line
    assert "ZeroDivisionError" in capsys.readouterr().err
    # and a store reopened later still has it
    assert RunStore(tmp_path / "s").engine_errors() == [rec]


def test_cli_reproduce_exit_code_reports_failures(tmp_path):
    plugin = tmp_path / "plug.py"
    plugin.write_text(
        "from softprior.cells import Cell\n"
        "from softprior.experiments import Experiment, register_experiment\n"
        "from softprior.config import make_run_config\n"
        "def build(o):\n"
        "    kw = dict(steps=20, eval_every=10, n_val=64, batch_size=16)\n"
        "    return [Cell(make_run_config('assoc_recall', 'unforced', 0, **kw), row='ok'),\n"
        "            Cell(make_run_config('assoc_recall', 'unforced', 1, lr=1e30, grad_clip=None, **kw), row='bad')]\n"
        "register_experiment(Experiment('tiny_fail', 'one good run, one diverging', build))\n")
    r = subprocess.run(_cli("reproduce", "tiny_fail", "--plugin", str(plugin), "--store", str(tmp_path / "s"),
                            "--out", str(tmp_path / "o"), "--no-progress"), env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1
    assert "1 trained, 1 failed" in r.stderr and "FAILED" in r.stderr
    assert "ok" in (tmp_path / "o" / "table.md").read_text()


def test_two_concurrent_reproduce_processes_share_one_store(tmp_path):
    store = tmp_path / "s"
    cmd = _cli("reproduce", "removability", "--quick", "--seeds", "2", "--store", str(store), "--no-progress")
    procs = [subprocess.Popen(cmd + ["--out", str(tmp_path / f"o{i}")], env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1500:] for o in outs]
    n = len(get_experiment("removability").build(Options(quick=True, seeds=2)))
    assert sum(_trained(o[1]) for o in outs) == n  # every run trained exactly once
    rows = RunStore(store).rows()
    assert len(rows) == n and all(r["status"] == "done" for r in rows)
    assert (tmp_path / "o0" / "table.csv").read_text() == (tmp_path / "o1" / "table.csv").read_text()


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray")
    # address="local": a new Ray of its own, even where a `ray start` cluster (or the address file
    # a stopped one left in /tmp/ray) is on this machine, which a plain ray.init() would try to join
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_executor_gives_the_same_table_as_local(tmp_path, ray_cluster):
    exp = get_experiment("removability")
    cells = exp.build(Options(quick=True))
    tables = []
    for executor in ("local", "ray"):
        store = RunStore(tmp_path / executor)
        report = execute([c.cfg for c in cells], store, executor=executor, workers=2, progress=False)
        assert report.trained == len(cells) and not report.failed
        tables.append(aggregate(collect(store, cells)))
    assert tables[0].equals(tables[1])


def test_a_ray_sweep_reports_steps_inside_its_jobs(tmp_path, ray_cluster, monkeypatch):
    """Progress on Ray: the jobs put their steps into a Ray queue the driver polls (issue 30)."""
    import softprior.executors.backends as ex
    monkeypatch.setattr(ex, "PROGRESS_SECONDS", 0.01)
    states = record_progress(monkeypatch)
    cfgs = [tiny_config(seed=s, steps=60) for s in range(2)]
    report = execute(cfgs, RunStore(tmp_path / "s"), executor="ray", workers=2, progress=True, require_calibration=False)
    assert report.trained == 2
    assert any(0 < n < total and finished == 0 for n, total, finished in states)
    assert states[-1] == (120, 120, 2)


def _ray_job_processes(psutil) -> list:
    """The Ray worker processes of this test session's Ray (descendants of this process) that are
    running a sweep job now: Ray titles a worker by the task it runs (``ray::_ray_work``), else ray::IDLE."""
    import softprior.executors.backends as ex
    title = f"ray::{ex._ray_work.__name__}"
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if title in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:  # gone meanwhile
            pass
    return out


def _sweep_with_a_worker_killed_mid_group(root, cfgs, groups, find_workers, kill, **kwargs):
    """Run ``execute(cfgs, RunStore(root), **kwargs)`` while a thread waits until every group of
    ``groups`` has checkpointed mid-training and ``find_workers()`` lists two job processes, then kills the
    first with ``kill``. Returns (the sweep's report, what was killed: [(pid, steps)])."""
    import threading

    from softprior.store.files import RunFiles
    killed, stop = [], threading.Event()

    def kill_a_worker_mid_group():
        files, deadline = RunFiles(root), time.time() + 120
        while not stop.is_set() and time.time() < deadline:
            steps = [ck["meta"]["step"] if ck else 0 for ck in (files.load_group_checkpoint(g) for g in groups)]
            procs = find_workers()
            if all(60 <= s < 250 for s in steps) and len(procs) == 2:  # both groups mid-training, checkpointed
                killed.append((kill(procs[0]), steps))
                return
            time.sleep(0.02)
    killer = threading.Thread(target=kill_a_worker_mid_group, daemon=True)
    killer.start()
    try:
        report = execute(cfgs, RunStore(root), group_size=2, require_calibration=False, checkpoint_seconds=0.05,
                         **kwargs)
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker was killed mid-group (the groups trained too fast or never checkpointed)"
    return report, killed


def test_a_ray_sweep_survives_a_worker_killed_mid_group(tmp_path, ray_cluster):
    """SIGKILL the Ray worker of a group while it trains: Ray runs the job again (``RAY_MAX_RETRIES``;
    with retries off its runs fail and this test does), the retry resumes from the group's checkpoint,
    and the sweep ends with every run stored once and the bits of a local sweep on the same configs."""
    psutil = pytest.importorskip("psutil")
    import softprior.executors.grouping as ex
    cfgs = [tiny_config(path=p, seed=s, steps=300, eval_every=50)
            for s, p in enumerate(["unforced", "fade600", "unforced", "fade600"])]
    groups = [[c.run_id for c in job] for job in ex._jobs(cfgs, 2)]
    assert sorted(len(g) for g in groups) == [2, 2]  # two groups of two, one per Ray CPU

    local = RunStore(tmp_path / "local")
    assert execute(cfgs, local, group_size=2, progress=False, require_calibration=False).trained == 4

    root = tmp_path / "ray"

    def kill(proc):
        proc.send_signal(signal.SIGKILL)
        return proc.pid
    report, _ = _sweep_with_a_worker_killed_mid_group(root, cfgs, groups, lambda: _ray_job_processes(psutil), kill,
                                                      executor="ray", workers=2, progress=True)
    assert report.trained == 4 and not report.failed, report.line()

    store = RunStore(root)
    rows = store.rows()
    assert len(rows) == 4 and all(r["status"] == "done" for r in rows)  # every run stored once
    resumed = {c.run_id: store.summary(c.run_id)["resumed_at"] for c in cfgs if "resumed_at" in store.summary(c.run_id)}
    assert sorted(resumed) in [sorted(g) for g in groups]  # the killed group, resumed from its checkpoint
    assert all(step >= 60 for step in resumed.values())
    for c in cfgs:
        assert store.metrics(c.run_id) == local.metrics(c.run_id)
        a, b = store.load_state(c.run_id), local.load_state(c.run_id)
        assert all(torch.equal(a[k], b[k]) for k in a)
        for k in ("normal_acc", "zero_acc", "normal_loss", "zero_loss"):
            assert store.summary(c.run_id)[k] == local.summary(c.run_id)[k], k
    assert not list(root.glob("runs/*/*checkpoint.safetensors"))  # scratch files go with the results
    # the retried job's ledger row counts the killed attempt's time up to its checkpoint, then the retry's
    pieces = {tuple(r["detail"]["run_ids"]): len(r["detail"]["pieces"]) for r in store.ledger() if r["kind"] == "job"}
    assert sorted(pieces.values()) == [1, 2] and pieces[tuple(next(g for g in groups if g[0] in resumed))] == 2


def _pool_workers() -> list[int]:
    """The pids of this process's spawned pool workers (Linux: read from /proc)."""
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if ppid == os.getpid() and "spawn_main" in cmd:
            out.append(int(d.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the pool's workers through /proc")
def test_a_local_sweep_survives_a_pool_worker_killed_mid_group(tmp_path):
    """SIGKILL a worker of the local process pool while both groups train: the pool breaks, is started
    again and takes both jobs again (``POOL_MAX_RETRIES``; with retries at 0 their runs fail and this
    test does), each resumes from its checkpoint, and the sweep ends with every run stored once and the
    bits of a sweep nobody killed."""
    import softprior.executors.grouping as ex
    cfgs = [tiny_config(path=p, seed=s, steps=300, eval_every=50)
            for s, p in enumerate(["unforced", "fade600", "unforced", "fade600"])]
    groups = [[c.run_id for c in job] for job in ex._jobs(cfgs, 2)]
    assert sorted(len(g) for g in groups) == [2, 2]
    clean = RunStore(tmp_path / "clean")
    assert execute(cfgs, clean, group_size=2, progress=False, require_calibration=False).trained == 4

    root = tmp_path / "killed"

    def kill(pid):
        os.kill(pid, signal.SIGKILL)
        return pid
    report, _ = _sweep_with_a_worker_killed_mid_group(root, cfgs, groups, _pool_workers, kill, workers=2,
                                                      progress=True)  # the progress queue restarts too
    assert report.trained == 4 and not report.failed, report.line()
    store = RunStore(root)
    assert len(store.rows()) == 4 and all(r["status"] == "done" for r in store.rows())
    resumed = [c.run_id for c in cfgs if "resumed_at" in store.summary(c.run_id)]
    assert resumed and all(store.summary(r)["resumed_at"] >= 60 for r in resumed)
    for c in cfgs:
        assert store.metrics(c.run_id) == clean.metrics(c.run_id)
        a, b = store.load_state(c.run_id), clean.load_state(c.run_id)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_crashed_job_keeps_its_checkpoint_and_the_next_sweep_resumes_it(tmp_path):
    """A job whose process died (a pool worker, a Ray job out of retries) fails its runs in this sweep
    but leaves its checkpoint, so the next sweep resumes the group instead of retraining it."""
    from softprior.executors.job import JobResult, work
    from softprior.executors.sweep import SweepReport, _collect
    cfgs = [tiny_config(seed=s, steps=40, checkpoint_every=10) for s in range(2)]
    store = RunStore(tmp_path / "s")
    work(cfgs, checkpoints=str(store.root), checkpoint_seconds=10 ** 6)  # leaves the step-30 checkpoint

    class Crashed:  # a backend whose job died
        def next_done(self, poll=None):
            return cfgs, None, JobResult([(None, "worker crashed: WorkerCrashedError")] * 2, crashed=True)

        def drain(self):
            return []
    report = SweepReport(total=2)
    _collect(Crashed(), store, report, set(), None, None)
    assert [rid for rid, _ in report.failed] == [c.run_id for c in cfgs]
    assert store.files.load_group_checkpoint([c.run_id for c in cfgs])["meta"]["step"] == 30

    again = execute(cfgs, store, group_size=2, progress=False, require_calibration=False)
    assert again.trained == 2 and not again.failed
    clean = RunStore(tmp_path / "clean")
    execute(cfgs, clean, group_size=2, progress=False, require_calibration=False)
    for c in cfgs:
        assert store.summary(c.run_id)["resumed_at"] == 30
        assert store.metrics(c.run_id) == clean.metrics(c.run_id)


def test_a_remote_ray_cluster_checkpoints_only_into_a_shared_store(tmp_path, monkeypatch):
    """Jobs on a cluster at --address write no checkpoints unless the store is shared
    (``shared_store`` / $SOFTPRIOR_SHARED_STORE); a node that does not see the store writes none."""
    import softprior.executors.backends as ex
    seen = []

    class Stop(Exception):
        pass

    def fake_ray(address, workers, checkpoints, *a, **kw):
        seen.append(checkpoints)
        raise Stop
    monkeypatch.setattr(ex, "_Ray", fake_ray)
    monkeypatch.delenv("SOFTPRIOR_SHARED_STORE", raising=False)
    store, cfgs = RunStore(tmp_path / "s"), [tiny_config()]
    root = str(store.root.resolve())
    for address, shared, env in [(None, None, ""), ("auto", None, ""), ("auto", True, ""), ("auto", None, "1"),
                                 ("auto", False, "1"), ("auto", None, "0")]:
        monkeypatch.setenv("SOFTPRIOR_SHARED_STORE", env)
        with pytest.raises(Stop):
            execute(cfgs, store, executor="ray", address=address, shared_store=shared, progress=False,
                    require_calibration=False)
    assert seen == [root, None, root, root, None, None]

    # on a node: a directory that is no store (not mounted there) gets no checkpoint files
    c = [tiny_config(checkpoint_every=5)]
    assert ex._ray_work(c, None, 1, str(tmp_path / "elsewhere"), 10 ** 6).outs[0][0] is not None
    assert not (tmp_path / "elsewhere").exists()
    ex._ray_work(c, None, 1, root, 10 ** 6)
    assert store.files.load_checkpoint(c[0].run_id)["meta"]["step"] == 15


def test_jobs_are_balanced_groups_longest_first():
    from softprior.config import make_run_config
    from softprior.executors.grouping import _jobs
    base = [make_run_config("assoc_recall", "unforced", s, steps=40, calibrated=False) for s in range(13)]
    large = [make_run_config("assoc_recall", "unforced", s, model="large", steps=40, calibrated=False) for s in range(3)]
    jobs = _jobs(base + large, 6)
    # 13 compatible runs in groups of at most 6: three groups of 5, 4, 4 (not 6, 6, 1)
    assert sorted(len(j) for j in jobs if j[0].model.n_layers == 2) == [4, 4, 5]
    assert sorted(c.run_id for j in jobs for c in j) == sorted(c.run_id for c in base + large)
    # the large model's group is the costliest job and is scheduled first
    assert jobs[0][0].model.n_layers == 4


def test_costlier_schemes_are_scheduled_first(monkeypatch):
    # same shapes and group sizes: the contextual schemes by their measured factors (DAPE, CoPE, GPSA)
    # before a bias scheme (ALiBi), so the slowest groups do not end a sweep running alone; a scheme off
    # the fast path costs READABLE_STEP_COST times its step there
    from softprior.executors import grouping
    from softprior.model import fastpath
    from softprior.config import make_run_config
    from softprior.executors.grouping import _jobs
    cfgs = [make_run_config("assoc_recall", seed=s, baseline=b, steps=40, calibrated=False)
            for b in ("alibi", "gpsa", "cope", "dape") for s in range(2)]
    assert all(fastpath.supports(c.model) for c in cfgs)  # every scheme on the fast path
    assert [j[0].model.positional for j in _jobs(cfgs, 2)] == ["dape", "cope", "gpsa", "alibi"]
    alibi = grouping._job_cost([cfgs[0]])
    supports = fastpath.supports
    monkeypatch.setattr(fastpath, "supports", lambda m: m.positional != "alibi" and supports(m))
    assert grouping._job_cost([cfgs[0]]) == alibi * grouping.READABLE_STEP_COST


def test_auto_group_size_is_the_smallest_near_best_k_and_leaves_every_worker_a_group():
    from softprior.executors.grouping import choose_group_size
    scaling = {1: 10.0, 2: 8.0, 4: 6.2, 8: 6.0, 16: 7.0}
    assert choose_group_size(1000, 2, scaling) == 4  # 6.2 is within 5% of the best 6.0; smaller balances better
    assert choose_group_size(6, 2, scaling) == 3  # an equal share per worker: both work
    assert choose_group_size(1, 2, scaling) == 1
    assert choose_group_size(1000, 1, {1: 5.0, 2: 9.0}) == 1  # where grouping does not pay, no groups
    # the README's main job (9 runs, 2 workers) on a table where K = 4 is within 5% of the best: K = 4 would
    # make three groups of 3 (two rounds); K = 5 makes two groups (5, 4) that train at once
    assert choose_group_size(9, 2, {1: 6.0, 2: 6.08, 4: 5.63, 8: 5.51, 16: 5.65}) == 5
    # the large model, where grouping only costs: alone, even for 3 runs on 2 workers
    assert choose_group_size(3, 2, {1: 45.8, 2: 48.6, 4: 50.6, 6: 48.2}) == 1


def test_auto_group_size_is_chosen_per_model_size(monkeypatch):
    # each model size gets its own K from its own table: here the base model groups (K = 4 is within
    # 5% of the best) and the large model trains alone (grouping it only costs)
    import softprior.executors.grouping as ex
    from softprior.config import make_run_config
    monkeypatch.setattr(ex, "GROUP_SCALING_BY_MODEL", {"base": {1: 10.0, 4: 6.2, 8: 6.0},
                                                      "large": {1: 45.0, 2: 48.0, 6: 47.0}})
    monkeypatch.setattr(ex, "GROUP_SCALING", {1: 10.0, 4: 6.2, 8: 6.0})
    base = [make_run_config("assoc_recall", "unforced", s, steps=40, calibrated=False) for s in range(16)]
    large = [make_run_config("assoc_recall", "unforced", s, model="large", steps=40, calibrated=False)
             for s in range(4)]
    sizes = ex.group_sizes(base + large, "auto", 2)
    assert sizes == {"base": 4, "large": 1}
    jobs = ex._jobs(base + large, sizes)
    assert sorted(len(j) for j in jobs if j[0].model.n_layers == 2) == [4, 4, 4, 4]
    assert sorted(len(j) for j in jobs if j[0].model.n_layers == 4) == [1, 1, 1, 1]
    assert ex.group_sizes(base + large, 3, 2) == {"base": 3, "large": 3}  # a fixed K is every size's


def test_saved_group_scaling_is_per_model_size_and_read_first(tmp_path, monkeypatch):
    import softprior.executors.grouping as ex
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ex.load_group_scaling() is None and ex.group_scaling("large") == ex.GROUP_SCALING_BY_MODEL["large"]
    ex.save_group_scaling({1: 9.0, 2: 5.0}, "base")
    ex.save_group_scaling({1: 40.0, 2: 30.0}, "large")  # keeps the base table beside it
    assert ex.load_group_scaling() == {1: 9.0, 2: 5.0} and ex.load_group_scaling("large") == {1: 40.0, 2: 30.0}
    assert ex.group_scaling("large") == {1: 40.0, 2: 30.0}
    assert ex.group_scaling("L3d96") == {1: 9.0, 2: 5.0}  # a size without a table: the base one
    (tmp_path / "softprior" / "group_scaling.json").write_text("{not json")
    assert ex.load_group_scaling("large") is None  # unreadable: the built-in tables


def test_execute_with_auto_group_trains_every_run(tmp_path):
    from softprior.config import make_run_config
    from softprior.store import RunStore
    cfgs = [make_run_config("assoc_recall", "unforced", s, steps=6, calibrated=False) for s in range(3)]
    rep = execute(cfgs, RunStore(tmp_path), group_size="auto", progress=False)
    assert rep.ok and rep.trained == 3
    with pytest.raises(ValueError, match="group_size"):
        execute(cfgs, RunStore(tmp_path / "b"), group_size="big", progress=False)


_KILLED_SWEEP = """
import sys
from softprior.executors.sweep import execute
from softprior.store import RunStore
sys.path.insert(0, {tests!r})
from conftest import tiny_config
cfgs = [tiny_config(path=p, seed=s, steps=400, eval_every=50) for s, p in enumerate(["unforced", "fade600", "prior_dropout0.5"])]
execute(cfgs, RunStore({store!r}), group_size=3, progress=False, require_calibration=False, checkpoint_seconds=0.05)
"""


def test_a_killed_sweep_resumes_its_group_from_the_checkpoint(tmp_path):
    """SIGKILL a sweep while its group trains; the next sweep resumes the group from its checkpoint
    (not from step 0) and ends with the bits of an uninterrupted sweep."""
    cfgs = [tiny_config(path=p, seed=s, steps=400, eval_every=50)
            for s, p in enumerate(["unforced", "fade600", "prior_dropout0.5"])]
    killed = tmp_path / "killed"
    script = _KILLED_SWEEP.format(tests=str(Path(__file__).parents[1]), store=str(killed))
    p = subprocess.Popen([sys.executable, "-c", script], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, seen = time.time() + 300, None
    while time.time() < deadline and p.poll() is None:
        seen = next(iter(killed.glob("runs/*/group_checkpoint.safetensors")), None)
        ck = seen and RunStore(killed).files.load_group_checkpoint([c.run_id for c in cfgs])
        if ck and ck["meta"]["step"] >= 100:
            break
        time.sleep(0.05)
    assert p.poll() is None and seen is not None, "the group finished before a checkpoint was seen"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert _done_count(killed) == 0

    store = RunStore(killed)
    report = execute(cfgs, store, group_size=3, progress=False, require_calibration=False)
    assert report.trained == 3 and not report.failed
    clean = RunStore(tmp_path / "clean")
    execute(cfgs, clean, group_size=3, progress=False, require_calibration=False)
    for c in cfgs:
        assert store.summary(c.run_id)["resumed_at"] >= 100  # resumed, not retrained from step 0
        assert "resumed_at" not in clean.summary(c.run_id)
        assert store.metrics(c.run_id) == clean.metrics(c.run_id)
        a, b = store.load_state(c.run_id), clean.load_state(c.run_id)
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list(killed.glob("runs/*/*checkpoint.safetensors"))  # scratch files go with the result


def test_a_checkpointed_group_is_kept_together_when_the_plan_changes(tmp_path):
    from softprior.executors.grouping import _jobs
    cfgs = [tiny_config(seed=s) for s in range(6)]
    kept = [[cfgs[4].run_id, cfgs[1].run_id]]
    jobs = _jobs(cfgs, 3, kept)
    assert [c.run_id for c in jobs[0]] == kept[0]  # as checkpointed, in its order
    rest = sorted(c.run_id for j in jobs[1:] for c in j)
    assert rest == sorted(c.run_id for i, c in enumerate(cfgs) if i not in (1, 4)) and all(len(j) <= 3 for j in jobs)


def test_a_job_that_crashes_again_from_its_kept_checkpoint_loses_it(tmp_path):
    """A crashed job keeps its checkpoint once; crashing again from it (the group itself may be the cause,
    e.g. memory at its size) drops it, so the next sweep is free to group the runs anew."""
    from softprior.executors.job import JobResult, work
    from softprior.executors.sweep import SweepReport, _collect
    cfgs = [tiny_config(seed=s, steps=40, checkpoint_every=10) for s in range(2)]
    store = RunStore(tmp_path / "s")
    work(cfgs, checkpoints=str(store.root), checkpoint_seconds=10 ** 6)
    rids = [c.run_id for c in cfgs]

    class Crashed:
        def next_done(self, poll=None):
            return cfgs, None, JobResult([(None, "worker crashed: WorkerCrashedError")] * 2, crashed=True)

        def drain(self):
            return []
    _collect(Crashed(), store, SweepReport(total=2), set(), None, None)
    assert store.files.checkpointed_group(rids[0]) == rids  # kept after the first crash
    _collect(Crashed(), store, SweepReport(total=2), set(), None, None)
    assert store.files.checkpointed_group(rids[0]) is None  # dropped after the second


def test_executor_settings_from_the_environment_are_checked(monkeypatch):
    from softprior.executors.environment import SettingError, _env_flag, _env_int
    for raw, want in (("", False), ("0", False), ("no", False), ("FALSE", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("SOFTPRIOR_SHARED_STORE", raw)
        assert _env_flag("SOFTPRIOR_SHARED_STORE") is want, raw
    monkeypatch.setenv("SOFTPRIOR_SHARED_STORE", "maybe")
    with pytest.raises(SettingError, match="SOFTPRIOR_SHARED_STORE"):
        _env_flag("SOFTPRIOR_SHARED_STORE")
    monkeypatch.setenv("SOFTPRIOR_RAY_MAX_RETRIES", "three")
    with pytest.raises(SettingError, match="SOFTPRIOR_RAY_MAX_RETRIES must be an integer"):
        _env_int("SOFTPRIOR_RAY_MAX_RETRIES", 3)
    monkeypatch.delenv("SOFTPRIOR_RAY_MAX_RETRIES")
    assert _env_int("SOFTPRIOR_RAY_MAX_RETRIES", 3) == 3
    from softprior.executors.environment import _env_seconds
    monkeypatch.setenv("SOFTPRIOR_CHECKPOINT_SECONDS", " 2.5 ")
    assert _env_seconds("SOFTPRIOR_CHECKPOINT_SECONDS", 60.0) == 2.5
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("SOFTPRIOR_CHECKPOINT_SECONDS", bad)
        with pytest.raises(SettingError, match="SOFTPRIOR_CHECKPOINT_SECONDS must be a positive number"):
            _env_seconds("SOFTPRIOR_CHECKPOINT_SECONDS", 60.0)
    monkeypatch.delenv("SOFTPRIOR_CHECKPOINT_SECONDS")
    assert _env_seconds("SOFTPRIOR_CHECKPOINT_SECONDS", 60.0) == 60.0


def test_performance_doc_quotes_the_built_in_group_scaling():
    """docs/PERFORMANCE.md's built-in rows are ``executors.grouping.GROUP_SCALING_BY_MODEL``, and the choice it says
    they make for the README's job (9 base runs, 2 workers) is ``choose_group_size``'s."""
    from pathlib import Path

    import softprior.executors.grouping as ex
    doc = (Path(__file__).resolve().parents[2] / "docs" / "PERFORMANCE.md").read_text()
    table = doc.split("Group scaling at 1 thread")[1].split("\n\n")[1]
    ks = [int(c.strip().removeprefix("K = ")) for c in table.splitlines()[0].strip("|").split("|")[1:]]
    for model, scaling in ex.GROUP_SCALING_BY_MODEL.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {model} (built in) |"))
        cells = [c.strip() for c in row.strip("|").split("|")[1:]]
        assert {k: float(c) for k, c in zip(ks, cells) if c} == scaling, model
    assert ex.GROUP_SCALING_BY_MODEL["base"] is ex.GROUP_SCALING
    k = ex.choose_group_size(9, 2, ex.GROUP_SCALING)
    assert f"README's 9-run job in groups of K = {k} on 2 workers" in " ".join(doc.split())
    assert ex.choose_group_size(3, 2, ex.GROUP_SCALING_BY_MODEL["large"]) == 1  # "and large runs alone"


_SWEEP_TO_STOP = """
import sys
from softprior.config import make_run_config
from softprior.executors.sweep import execute
from softprior.store import RunStore
kw = dict(eval_every=10, n_val=16, batch_size=8, calibrated=False, checkpoint_every=0)
cfgs = [make_run_config("assoc_recall", "unforced", 0, steps=20, **kw),
        make_run_config("assoc_recall", "unforced", 1, steps=1_000_000, **kw)]
try:
    rep = execute(cfgs, RunStore(sys.argv[1]), workers=2, progress=False)
    print("finished", rep.trained, flush=True)
except KeyboardInterrupt as e:
    print("interrupted", flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_driver_alone_stops_the_workers_and_keeps_finished_runs(tmp_path, sig):
    """``kill -INT PID`` (what ``timeout -s INT`` sends) or SIGTERM reaches the sweep's driver, not its
    workers: the driver tells them, each checkpoints and stops, and the runs that finished are kept, so
    the re-run counts them as done and resumes the others."""
    import signal
    import subprocess
    import sys
    import time

    from softprior.config import make_run_config
    from softprior.store import RunStore
    kw = dict(eval_every=10, n_val=16, batch_size=8, calibrated=False, checkpoint_every=0)
    short = make_run_config("assoc_recall", "unforced", 0, steps=20, **kw)
    long_runs = [make_run_config("assoc_recall", "unforced", 1, steps=1_000_000, **kw)]
    root = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-c", _SWEEP_TO_STOP, str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:  # until the short run is in the store
        if (root / "index.sqlite").exists() and RunStore(root).is_done(short.run_id):
            break
        time.sleep(0.5)
    time.sleep(3)  # the long run under way in the other worker
    assert proc.poll() is None, proc.stderr.read()[-2000:]
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=300)  # (a hang guard: the old driver waited for its workers' whole runs)
    assert proc.returncode == 130 and "interrupted" in out, err[-2000:]
    store = RunStore(root)
    assert store.is_done(short.run_id) and not any(store.is_done(c.run_id) for c in long_runs)
    ckpts = [store.files.load_checkpoint(c.run_id) for c in long_runs]
    assert all(ck is not None and ck["meta"]["step"] > 0 for ck in ckpts), "an interrupted run left no checkpoint"


def test_a_pools_threads_per_worker_count_the_cores_this_process_may_use(monkeypatch):
    """Under taskset or a cgroup's CPU set a worker gets its share of the cores it may run on, not of the
    machine's: two threads per worker on one allowed core oversubscribe it (OpenMP waits, measured 50x
    slower on a small kernel beside a busy sweep)."""
    import os

    from softprior.executors import backends
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1}, raising=False)
    assert backends._Pool(1, None, None).threads == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert backends._Pool(2, None, None).threads == 4
