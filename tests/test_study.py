"""``softprior study`` and the two registries it rests on (src/softprior/study.py, model/priors.py, the task
registry in tasks/registry.py, plugins.py), with the two worked examples of examples/, end to end at a
tiny size."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from softprior.plugins import ENV, load_plugin

ROOT = Path(__file__).resolve().parents[1]
GAUSS = ROOT / "examples" / "gaussian_window.py"
SECOND = ROOT / "examples" / "second_occurrence.py"


@pytest.fixture
def plugins(monkeypatch):
    """Both example plugins loaded (once per process; the environment note undone after the test)."""
    monkeypatch.setenv(ENV, "")
    load_plugin(str(GAUSS))
    load_plugin(str(SECOND))


def _tiny(task, prior, tmp_path, **kw):
    from softprior.study import StudyPlan
    opts = dict(quick=True, steps=4, seeds=1, budget=1, out=str(tmp_path / "study"), group_size=8, trace_examples=32)
    return StudyPlan(task=task, prior=prior, **{**opts, **kw})


def test_the_gaussian_window_is_the_bias_the_model_adds(plugins):
    from softprior.model import fastpath
    from softprior.config import make_run_config
    from softprior.model.transformer import build_model
    cfg = make_run_config("assoc_recall", "unforced", 0, model_options={"prior_family": "gaussian_window",
                                                                        "prior_scale": 1.0, "prior_layers": (0,)})
    model = build_model(cfg)
    _, cache = model.run_with_cache(torch.randint(0, 32, (2, 32)), names_filter=lambda n: "pos_bias" in n)
    i = torch.arange(32)
    r2 = ((i[:, None] - i[None, :]).clamp(min=0) ** 2).float()
    want = torch.stack([-r2 / (2.0 * (h + 1) ** 2) for h in range(4)])  # sigma_h = h + 1 at prior_scale 1
    assert torch.allclose(cache["blocks.0.attn.hook_pos_bias"], want, atol=1e-5)
    assert cache["blocks.1.attn.hook_pos_bias"].abs().max() == 0  # outside prior_layers: no B^pos
    # the plugin family trains on the fast path, its bias given to the attention as data: the same logits
    assert fastpath.supports(cfg.model)
    x, pos = torch.randint(0, 32, (2, 32)), torch.tensor([31])
    with torch.no_grad():
        assert torch.allclose(fastpath.model_forward(model, x, positions=pos), model(x, positions=pos), atol=1e-4)
    # the width is learned: the loss reaches it
    model(torch.randint(0, 32, (2, 32)))[:, -1].logsumexp(-1).sum().backward()
    assert model.blocks[0].attn.prior_module.width_param.grad.abs().sum() > 0


def test_registries_name_their_entries_and_refuse_unknown_ones(plugins):
    from softprior.model.priors import PRIORS, UnknownPriorError
    from softprior.tasks.registry import TASK_SPECS, UnknownTaskError, task_spec
    assert list(PRIORS)[0] == "soft" and {"alibi", "t5", "gaussian_window"} <= set(PRIORS)
    assert {"assoc_recall", "markov", "linear_icl", "second_occurrence"} <= set(TASK_SPECS)
    assert task_spec("second_occurrence").plugin == str(SECOND)
    with pytest.raises(UnknownTaskError, match="allowed: assoc_recall"):
        task_spec("sorting")
    with pytest.raises(ValueError, match="unknown prior 'nope'"):
        from softprior.config import make_run_config
        make_run_config("assoc_recall", model_options={"prior_family": "nope"})
    assert issubclass(UnknownPriorError, ValueError)


def test_a_plugin_prediction_row_is_refused_without_a_record(plugins, tmp_path):
    from softprior.config import make_run_config
    from softprior.executors.sweep import execute
    from softprior.preregistration import CalibrationMissing, needs_record
    from softprior.store import RunStore
    fade = make_run_config("second_occurrence", "fade600", 0, steps=2)
    assert needs_record(fade) and not needs_record(make_run_config("second_occurrence", "unforced", 0, steps=2))
    store = RunStore(tmp_path / "runs")
    with pytest.raises(CalibrationMissing):
        execute([fade], store, progress=False)
    assert store.status(fade.run_id) is None  # refused before training


def test_plugin_configs_reach_a_spawned_worker(plugins, monkeypatch):
    """A worker unpickles a plugin task's config, and builds a plugin prior's model, by loading the
    files the environment names (as the executors' spawned workers do)."""
    from softprior.config import make_run_config
    cfg = make_run_config("second_occurrence", "unforced", 3, task_options={"vocab": 24},
                          model_options={"prior_family": "gaussian_window"})
    code = ("import pickle, sys, torch; from softprior.tasks.generators import make_task; from softprior.model.transformer import build_model; "
            "c = pickle.load(sys.stdin.buffer); b = make_task(c.task).sample(4, 32, torch.Generator().manual_seed(0)); "
            "m = build_model(c); print(c.run_id, bool(b.inputs.max() < 24), type(m.blocks[0].attn.prior_module).__name__)")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(cfg), capture_output=True, timeout=300,
                         env={**os.environ, ENV: os.pathsep.join([str(SECOND), str(GAUSS)])})
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split() == [cfg.run_id, "True", "GaussianWindow"]


def test_default_criteria_and_claims_are_levels_of_the_span():
    from softprior.claims import verdicts
    from softprior.study import default_criteria, study_claims
    acc = {c.name: c.bounds() for c in default_criteria("acc", 0.1, 0.9)}
    assert acc["unforced learns"] == pytest.approx((0.5, float("inf")))  # .1 + .5 x .8
    assert acc["forced_zero does not"] == pytest.approx((float("-inf"), 0.26))  # .1 + .2 x .8
    mse = {c.name: c.bounds() for c in default_criteria("mse", 1.0, 0.0)}
    assert mse["unforced learns"] == pytest.approx((float("-inf"), 0.5))
    assert mse["forced_zero does not"] == pytest.approx((0.8, float("inf")))
    claims = study_claims("acc", 0.1, 0.9)
    t = {("fade600", "zero"): 0.81, ("fade600", "zero", "values"): [0.80, 0.82, 0.81], ("fade600", "zero", "n"): 3.0,
         ("hard_switch1050", "zero"): 0.31, ("hard_switch1050", "zero", "values"): [0.30, 0.32, 0.31],
         ("hard_switch1050", "zero", "n"): 3.0}
    got = {cl.name: v for cl, v, _ in verdicts({"study": t}, claims)}
    assert got["fade keeps"] == "reproduced"  # .81 >= .1 + .7 x .8 = .66 on its interval
    assert got["late hard switch"] == "reproduced"  # .31 - .81 = -.5 <= -.26 x .8
    assert got["posthoc fails"] == "not measured"


def _verdicts(report: Path) -> str:
    text = report.read_text()
    return text[text.index("## Verdicts"):text.index("## 1.")]


def _study(task, prior, tmp_path, resume=True, **kw):
    from softprior.store import RunStore
    from softprior.study import STUDY_PATHS, StudyError, run_study
    store = RunStore(tmp_path / "runs")
    plan = _tiny(task, prior, tmp_path, **kw)
    report = run_study(plan, store, log=lambda m: None)
    verdict = _verdicts(report)
    for cl in ("prior helps", "unforced relies", "fade keeps", "linear anneal", "constant gate", "late hard switch",
               "early hard switch", "posthoc fails"):
        assert f"**{cl}**" in verdict
    pre = json.loads((plan.dir / "preregistration.json").read_text())
    assert pre["record"] in {r["hash"] for r in store.calibration_records()}
    rows = store.rows()
    if not resume:
        return plan, store, len(STUDY_PATHS)
    # resumed: nothing more trains, the same verdicts
    before = len(rows)
    assert _verdicts(run_study(_tiny(task, prior, tmp_path, **kw), store, log=lambda m: None)) == verdict
    assert len(store.rows()) == before
    with pytest.raises(StudyError, match="other settings"):
        run_study(_tiny(task, prior, tmp_path, **{**kw, "steps": 5}), store, log=lambda m: None)
    # claims edited after they were pre-registered: refused before anything more trains
    f = plan.dir / "preregistration.json"
    f.write_text(json.dumps({**pre, "chance": pre["chance"] + 0.01}))
    with pytest.raises(StudyError, match="pre-registered"):
        run_study(_tiny(task, prior, tmp_path, **kw), store, log=lambda m: None)
    assert len(store.rows()) == before
    return plan, store, len(STUDY_PATHS)


def test_study_of_a_plugin_prior_end_to_end(plugins, tmp_path):
    plan, store, n_paths = _study("assoc_recall", "gaussian_window", tmp_path)
    cfgs = [store.load_config(r["run_id"]) for r in store.rows()]
    assert {c.model.prior_family for c in cfgs} == {"gaussian_window"}
    assert len(cfgs) >= n_paths  # every path (and the search's rows) trained
    assert (plan.dir / "zero_gate.png").exists() and (plan.dir / "trace.png").exists()


def test_study_of_a_plugin_task_end_to_end(plugins, tmp_path):
    """Two candidates, so the robustness map trains the paths on the one not chosen (no record covers
    it: the map is exploratory, as calibration's); the difficulty rows are the search's own runs."""
    plan, store, n_paths = _study("second_occurrence", "soft", tmp_path, resume=False, budget=2)
    cfgs = [store.load_config(r["run_id"]) for r in store.rows()]
    assert {c.task.name for c in cfgs} == {"second_occurrence"}
    text = (plan.dir / "REPORT.md").read_text()
    assert "ceiling 1.000" in text and "## 4. The robustness map" in text and "| prior helps |" in text
    # per candidate the 8 paths, no more: unforced and forced_zero are the search's runs, posthoc's parent the unforced
    assert len(cfgs) == 2 * n_paths


def test_the_map_trains_no_more_candidates_than_its_limit(plugins, tmp_path):
    """--map 0: the second candidate keeps its search's two rows, and no path trains on it; a resumed study
    with another limit is refused (its map would differ from the one its report shows)."""
    from softprior.study import StudyError, run_study
    plan, store, n_paths = _study("second_occurrence", "soft", tmp_path, resume=False, budget=2, map_limit=0)
    assert len(store.rows()) == n_paths + 2
    text = (plan.dir / "REPORT.md").read_text()
    assert "Only the chosen candidate is mapped (`--map 0`)" in text and "on the 0 nearest other candidate(s)" in text
    assert json.loads((plan.dir / "verdicts.json").read_text())["map_limit"] == 0
    with pytest.raises(StudyError, match="map_limit"):
        run_study(_tiny("second_occurrence", "soft", tmp_path, budget=2, map_limit=1), store, log=lambda m: None)


def test_a_static_scheme_serves_as_a_removable_prior():
    """ALiBi's bias (Press et al. 2022: -m_h |i - j|, m_h = 2^(-8 (h+1) / H)) is B^pos under the gate."""
    from softprior.config import make_run_config
    from softprior.model.transformer import build_model
    model = build_model(make_run_config("assoc_recall", "unforced", 0, model_options={"prior_family": "alibi"}))
    x = torch.randint(0, 32, (2, 32))
    _, cache = model.run_with_cache(x, names_filter="blocks.0.attn.hook_pos_bias")
    i = torch.arange(32).float()
    want = torch.stack([-(2.0 ** (-8.0 * (h + 1) / 4)) * (i[:, None] - i[None, :]).abs() for h in range(4)])
    assert torch.allclose(cache["blocks.0.attn.hook_pos_bias"], want)
    # the gate removes it: at zero gate the model is the same function whatever the prior family
    plain = build_model(make_run_config("assoc_recall", "unforced", 0))
    plain.load_state_dict(model.state_dict(), strict=False)
    assert torch.allclose(model(x, 0.0, 0.0), plain(x, 0.0, 0.0), atol=1e-5)
    assert not torch.allclose(model(x, 1.0, 0.0), plain(x, 1.0, 0.0), atol=1e-3)


def test_study_errors_are_one_line(tmp_path, capsys):
    from softprior.cli import main
    base = ["study", "--store", str(tmp_path / "runs"), "--out", str(tmp_path / "study")]
    assert main(base + ["--task", "sorting"]) == 2
    assert main(base + ["--task", "assoc_recall", "--prior", "nope"]) == 2
    assert main(base + ["--task", "assoc_recall", "--plugin", str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "unknown task 'sorting'" in err[0] and "unknown prior 'nope'" in err[1]
    assert "missing.py" in err[2] and "does not exist" in err[2]


def _study_table(unforced_normal: list[float]) -> dict:
    """A study's table: unforced at ``unforced_normal``, every other cell at chance (.167 of a .781 ceiling)."""
    rows = {"unforced": {"normal": unforced_normal, "zero": [0.10, 0.11, 0.09]}}
    for path in ("forced_zero", "fade600", "linear0.5->0", "forced_const0.5", "hard_switch1050", "hard_switch600",
                 "posthoc"):
        rows[path] = {"normal": [0.16, 0.17, 0.18], "zero": [0.16, 0.17, 0.18]}
    t = {}
    for path, cols in rows.items():
        for col, vs in cols.items():
            t[(path, col)] = sum(vs) / len(vs)
            t[(path, col, "values")] = vs
            t[(path, col, "n")] = len(vs)
    return {"study": t}


def test_claims_about_what_training_keeps_are_not_applicable_where_the_model_did_not_learn():
    """A quick study whose models learned nothing read "reproduced" on claims such as "post hoc
    continuation does not recover" (it cannot recover what was never learned): those claims now
    read "not applicable"; where the unforced model learned, they are decided as before."""
    from softprior.claims import NOT_APPLICABLE, verdicts
    from softprior.study import study_claims
    claims = study_claims("acc", 1 / 6, 0.781)
    keeps = {"unforced relies", "fade keeps", "linear anneal", "late hard switch", "early hard switch", "posthoc fails"}
    unlearned = {cl.name: v for cl, v, _ in verdicts(_study_table([0.01, 0.0, 0.015]), claims)}
    assert {n for n, v in unlearned.items() if v == NOT_APPLICABLE} == keeps
    assert unlearned["prior helps"].startswith("partly")  # the learning claim itself is decided (forced_zero holds)
    learned = {cl.name: v for cl, v, _ in verdicts(_study_table([0.78, 0.77, 0.79]), claims)}
    assert NOT_APPLICABLE not in learned.values()
    assert learned["posthoc fails"] == "reproduced" and learned["fade keeps"] == "not reproduced"


def test_an_interval_of_equal_seeds_says_it_has_no_spread():
    from softprior.claims import Cond
    t = {"x": {("a", "zero"): 0.082, ("a", "zero", "values"): [0.082, 0.082], ("a", "zero", "n"): 2,
               ("b", "zero"): 0.1, ("b", "zero", "values"): [0.09, 0.11], ("b", "zero", "n"): 2}}
    _, text = Cond("x", "a", "zero", "<=", 0.15).measure(t)
    assert "no spread: every seed gave 0.082" in text and "CI [0.082, 0.082]" not in text
    _, text = Cond("x", "b", "zero", "<=", 0.15).measure(t)
    assert "two seeds: a wide interval" in text
