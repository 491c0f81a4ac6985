"""Shared fixtures for the softprior unit tests.

Every run here is tiny (tens of steps, batch 16, 64 validation examples) so the whole suite stays
fast on a shared 2-core machine. Torch is limited to one intra-op thread: for models this small the
thread pool only adds overhead and contention with other processes.
"""

from __future__ import annotations

import pytest
import torch

from softprior.config import make_run_config
from softprior.store import RunStore

torch.set_num_threads(1)

# The quick subset: ``python -m pytest`` (no files named) skips the tests marked slow, or whose module
# is in SLOW_MODULES (each over a few seconds: digests of every preset and path, subprocess builds,
# notebooks, whole sweeps and reports); ``--full`` (CI) runs every test. Naming files or tests runs
# them all. The README states both durations.
SLOW_MODULES = {"test_bit_identity.py", "test_tour.py", "test_kernels_build.py", "test_cli_fuzz.py"}
SLOW_TESTS = {  # over 5 s each (pytest --durations): killed and resumed sweeps, Ray, whole searches and reports
    "test_reproduce_survives_sigkill_and_resumes_only_missing_runs", "test_single_run_killed_mid_training_resumes_bit_identically",
    "test_two_concurrent_reproduce_processes_share_one_store", "test_a_local_sweep_survives_a_pool_worker_killed_mid_group",
    "test_ray_executor_gives_the_same_table_as_local", "test_a_ray_sweep_survives_a_worker_killed_mid_group",
    "test_a_signal_to_the_driver_alone_stops_the_workers_and_keeps_finished_runs",
    "test_a_killed_sweep_resumes_its_group_from_the_checkpoint",
    "test_committed_documents_equal_what_the_committed_bundle_regenerates",
    "test_documents_regenerate_from_the_bundle_byte_for_byte_without_the_store",
    "test_identification_search_registers_its_set_on_five_seeds_and_covers_only_it",
    "test_an_effect_search_measures_the_trajectory_effect_in_its_own_store_and_shows_its_largest",
    "test_search_killed_and_resumed_gives_the_same_table", "test_bench_json_reports_the_issue_figures",
    "test_continuation_trace_experiment_end_to_end", "test_tuned_allocator_removes_page_faults_per_step",
}


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="run every test (CI does); without it and without "
                     "named files, the quick subset (tests/conftest.py)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of the quick subset (run with --full)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full") or config.args_source == pytest.Config.ArgsSource.ARGS:
        return
    skip = pytest.mark.skip(reason="slow: in the full suite (python -m pytest --full)")
    for item in items:
        if item.get_closest_marker("slow") is not None or item.path.name in SLOW_MODULES or \
                item.originalname in SLOW_TESTS:
            item.add_marker(skip)

TINY = dict(steps=20, eval_every=10, n_val=64, batch_size=16)


def record_progress(monkeypatch) -> list[tuple[int, int, int]]:
    """(run-steps shown, total, runs finished) at every redraw of the sweep bar
    (``executors.progress._Progress``), recorded in the returned list for the rest of the test."""
    import softprior.executors.progress as ex
    states = []
    redraw = ex._Progress._redraw

    def recording(self):
        redraw(self)
        if self.bar is not None:  # (none drawn while there is nothing to train)
            states.append((self.bar.n, self.bar.total, self.finished))
    monkeypatch.setattr(ex._Progress, "_redraw", recording)
    return states


def tiny_config(task="assoc_recall", path="unforced", seed=0, **overrides):
    """A RunConfig with steps=20, eval_every=10, n_val=64, batch_size=16 unless overridden, on the
    plain config defaults (the first version's task and initialisation: shared gates, 10 pairs), so
    mechanics tests do not move with the pre-registered calibration (``calibrated=True`` to use it)."""
    kw = {**TINY, "calibrated": False, **overrides}
    return make_run_config(task, path, seed, **kw)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Tests never write the user's cache (``softprior bench`` saves its group scaling there)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def make_cfg():
    """Factory fixture: ``make_cfg(task=..., path=..., seed=..., **RunConfig overrides)``."""
    return tiny_config


@pytest.fixture
def tiny_cfg():
    """The default tiny run: associative recall, unforced, seed 0, 20 steps."""
    return tiny_config()


@pytest.fixture
def store(tmp_path):
    """An empty run store in a fresh temporary directory."""
    return RunStore(tmp_path / "store")


def state_dicts_equal(a: dict, b: dict) -> bool:
    """Bit-identical comparison of two state dicts (same keys, same dtypes, equal values)."""
    if set(a) != set(b):
        return False
    return all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def patch_train(monkeypatch, fn):
    """Replace ``softprior.training.loop.train`` with ``fn`` wherever the sweep machinery (``executors``) looks it up
    (the module attribute, and names bound by ``from .train import train``). Returns the original."""
    import importlib

    train_mod = importlib.import_module("softprior.training.loop")
    orig = train_mod.train
    for name in ("softprior.training.loop", "softprior.executors.job"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(mod, "train", None) is orig:
            monkeypatch.setattr(mod, "train", fn)
    return orig


@pytest.fixture
def train_calls(monkeypatch):
    """Count the trainings the sweep driver starts; records ``(cfg, kwargs)`` per call."""
    calls = []
    orig = None

    def counting(cfg, *args, **kw):
        calls.append((cfg, kw))
        return orig(cfg, *args, **kw)

    orig = patch_train(monkeypatch, counting)
    return calls
