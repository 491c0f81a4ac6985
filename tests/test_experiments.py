"""The experiment registry, plugins and report generation."""

from __future__ import annotations

import pytest

from softprior.cells import Cell
from softprior.cli import main
from softprior.executors.sweep import execute
from softprior.experiments import (QUICK_STEPS, Experiment, Options, UnknownExperimentError, get_experiment,
                                   list_experiments, register_experiment)
from softprior.plugins import load_plugin
from softprior.reports.experiment import aggregate, collect, markdown_table, write_report
from softprior.store import RunStore

from conftest import tiny_config

SPEC_EXPERIMENTS = ["static_baselines", "gate_interventions", "paths", "causal_controls", "fade_window", "fade_shapes",
                    "markov_paths", "linear_paths", "extra_controls", "length_generalisation", "mechanism_trace",
                    "removability"]


def test_every_spec_experiment_is_registered_and_builds():
    names = [n for n, _ in list_experiments()]
    for n in SPEC_EXPERIMENTS:
        assert n in names
        cells = get_experiment(n).build(Options(quick=True))
        assert cells and all(c.cfg.steps == QUICK_STEPS for c in cells)
    with pytest.raises(UnknownExperimentError, match="allowed"):
        get_experiment("nope")


def test_paper_seed_counts_are_the_defaults():
    cells = get_experiment("paths").build(Options())
    seeds = {}
    for c in cells:
        seeds.setdefault((c.row, c.col), set()).add(c.cfg.seed)
    assert len(seeds[("fade600", "base")]) == 5 and len(seeds[("unforced", "large")]) == 3
    assert {c.cfg.model.d_model for c in cells} == {64, 128}
    assert all(c.cfg.steps == 3600 for c in cells)
    t2 = get_experiment("causal_controls").build(Options(seeds=2))
    assert {c.row for c in t2} == {"fade600", "hard_switch1050", "hard_switch600", "posthoc", "unforced", "forced_zero"}
    posthoc = [c for c in t2 if c.row == "posthoc"][0].cfg
    assert posthoc.parent().path.name == "unforced" and posthoc.total_steps == 2550


def test_markov_and_baseline_experiments_cover_their_grid():
    mk = get_experiment("markov_paths").build(Options(seeds=1))
    assert {c.col for c in mk} == {"p=0.2", "p=0.5", "p=0.8"} and {c.cfg.task.p for c in mk} == {0.2, 0.5, 0.8}
    sb = get_experiment("static_baselines").build(Options(seeds=1))
    assert len({c.row for c in sb}) == 13 and len({c.col for c in sb}) == 5
    lg = get_experiment("length_generalisation").build(Options(seeds=1))
    assert {e.length for c in lg for e in c.evals} == {None, 120}


def test_user_experiment_from_a_python_file(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("from softprior.experiments import Experiment, Cell, register_experiment\n"
                 "from softprior.config import make_run_config\n"
                 "register_experiment(Experiment('mine_x', 'a user experiment', lambda o: "
                 "[Cell(make_run_config('assoc_recall', 'fade40', s, steps=20, eval_every=10, n_val=32, batch_size=8), "
                 "row='fade40') for s in range(2)]))\n")
    load_plugin(str(f))
    assert get_experiment("mine_x").description == "a user experiment"
    with pytest.raises(ValueError, match="already registered"):
        register_experiment(Experiment("mine_x", "again", lambda o: []))


def test_report_rebuilds_from_the_store_without_training(tmp_path, capsys):
    cells = [Cell(tiny_config(path=p, seed=s), row=p) for p in ("unforced", "forced_zero") for s in range(2)]
    exp = Experiment("tiny_report", "two paths, two seeds", lambda o: cells)
    store = RunStore(tmp_path / "s")
    execute([c.cfg for c in cells], store, progress=False)
    md = write_report(store, exp, cells, tmp_path / "out")
    agg = aggregate(collect(store, cells))
    # mean over seeds computed independently from the stored summaries
    zs = [store.summary(c.cfg.run_id)["zero_acc"] for c in cells if c.row == "unforced"]
    got = agg[(agg.row == "unforced") & (agg.column == "zero")]["mean"].item()
    assert got == pytest.approx(sum(zs) / 2)
    assert "| unforced |" in md and (tmp_path / "out" / "figure.png").exists()
    assert (tmp_path / "out" / "curves.png").exists()
    again = write_report(store, exp, cells, tmp_path / "out2")
    assert again == md
    assert (tmp_path / "out" / "table.csv").read_text() == (tmp_path / "out2" / "table.csv").read_text()


def test_report_on_an_empty_store_says_so(tmp_path):
    cells = [Cell(tiny_config(), row="unforced")]
    md = write_report(RunStore(tmp_path / "s"), Experiment("e", "d", lambda o: cells), cells, tmp_path / "o")
    assert "no finished runs" in md and "1 of 1 runs are missing" in md


@pytest.mark.parametrize("task", ["assoc_recall", "linear_icl"])
def test_gate_override_evaluations_are_computed_from_weights(tmp_path, task):
    """Each evaluation equals one computed here independently: weights read from final.safetensors
    into the readable model, all positions computed, the model's own gates taken as sigmoid of the
    stored logits and forced, the metric written out by hand. linear_icl's MSE is continuous, so
    there the four evaluations are all different and any mix-up of gates or lengths shows."""
    import torch
    from safetensors.torch import load_file

    from softprior.cells import Eval, NORMAL, ZERO
    from softprior.model.transformer import SoftPriorTransformer
    from softprior.tasks.generators import make_task

    cfg = tiny_config(task=task, steps=30)
    store = RunStore(tmp_path / "s")
    execute([cfg], store, progress=False)
    cell = Cell(cfg, row="soft_bias", evals=(NORMAL, ZERO, Eval("pos=0", (0.0, None)), Eval("T=120", None, 120)))
    long = collect(store, [cell])
    vals = dict(zip(long["eval"], long["value"]))
    s = store.summary(cfg.run_id)
    assert vals["normal"] == s[f"normal_{s['metric']}"] and vals["zero"] == s[f"zero_{s['metric']}"]

    state = load_file(str(tmp_path / "s" / "runs" / cfg.run_id / "final.safetensors"))
    model = SoftPriorTransformer(cfg.model)
    model.load_state_dict(state)
    own = torch.sigmoid(state["gate_logits"]).reshape(2)  # shared gates: one (pos, content) value

    def by_hand(length, g_pos, g_content):
        val = make_task(cfg.task).sample(cfg.n_val, length, torch.Generator().manual_seed(cfg.val_seed))
        with torch.no_grad():
            last = model(val.inputs, g_pos, g_content)[:, -1]
        if task == "assoc_recall":
            return float((last.argmax(-1) == val.targets).float().mean())
        return float(((last[:, 0] - val.targets[:, -1]) ** 2).mean() / cfg.task.d)

    expected = {"normal": by_hand(32, own[0], own[1]), "zero": by_hand(32, 0.0, 0.0),
                "pos=0": by_hand(32, 0.0, own[1]), "T=120": by_hand(120, own[0], own[1])}
    for name, want in expected.items():
        if task == "assoc_recall":
            assert abs(vals[name] - want) <= 1.0 / cfg.n_val, name  # at most one near-tie flipped
        else:
            assert vals[name] == pytest.approx(want, rel=1e-4), name
    if task == "linear_icl":
        assert len({round(v, 6) for v in expected.values()}) == 4, expected


def test_markdown_table_marks_unequal_seed_counts():
    import pandas as pd
    long = pd.DataFrame({"row": ["a", "a", "b"], "col": ["", "", ""], "eval": ["zero"] * 3, "seed": [0, 1, 0],
                         "metric": ["acc"] * 3, "value": [0.5, 0.7, 0.2], "run_id": ["x", "y", "z"]})
    md = markdown_table(aggregate(long), {("a", "zero"): ".6"})
    assert "0.600 ± 0.141" in md and "(n=1)" in md and "paper zero" in md


def test_cli_experiments_and_unknown_names(capsys):
    assert main(["experiments"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in SPEC_EXPERIMENTS)
    assert main(["reproduce", "nope"]) == 2
    assert "unknown experiment 'nope'" in capsys.readouterr().err
    assert main(["baselines"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 13


def test_splice_into_doc_replaces_only_its_block(tmp_path):
    from softprior.reports.experiment import splice_into_doc
    doc = tmp_path / "R.md"
    doc.write_text("# Results\n\nintro\n")
    splice_into_doc(doc, "paths", "| a |\n")
    splice_into_doc(doc, "other", "| b |\n")
    splice_into_doc(doc, "paths", "| new |\n")
    text = doc.read_text()
    assert text.count("<!-- table:paths -->") == 1 and "| new |" in text and "| a |" not in text
    assert "| b |" in text and text.startswith("# Results\n\nintro\n")


def test_a_masked_gate_path_is_read_at_g_half_beside_its_normal_where_they_differ():
    """"normal" on a path that forces a gate reads sigmoid(initial logit): at a logit of -1 that is .269,
    not .5, so the path's cells also read g = .5 (and the table names the gate); a learned gate, or a
    logit of 0 (sigmoid .5), reads once."""
    import pandas as pd

    from softprior.cells import HALF, NORMAL, ZERO, Cell, readings
    from softprior.config import make_run_config
    from softprior.reports.experiment import reading_note
    at = make_run_config("assoc_recall", "fade600", 0, model_options={"gate_logit_init": -1.0})
    assert readings(at, (ZERO, NORMAL)) == (ZERO, NORMAL, HALF) and HALF.gates == (0.5, 0.5)
    learned = make_run_config("assoc_recall", "unforced", 0, model_options={"gate_logit_init": -1.0})
    zero_logit = make_run_config("assoc_recall", "forced_const0.5", 0, model_options={"gate_logit_init": 0.0})
    assert readings(learned, (ZERO, NORMAL)) == (ZERO, NORMAL) == readings(zero_logit, (ZERO, NORMAL))
    long = pd.DataFrame({"eval": ["normal", "g=.5"]})
    note = reading_note([Cell(at, "fade600", evals=readings(at, (ZERO, NORMAL)))], long)
    assert "sigmoid(initial logit) = 0.269 (initial logit -1)" in note and 'the column "g=.5"' in note
    assert "not measured here" in reading_note([Cell(at, "fade600", evals=(ZERO, NORMAL, HALF))], long.iloc[:1])
    assert reading_note([Cell(learned, "unforced")], long) == ""


def test_the_length_test_reads_the_records_registered_length_reading():
    """On a record that registered "no bias beyond" (identified-assoc_recall), the length test also reads
    T = 120 that way, and the identification row reads that column; the reading changes the model's
    B^pos past the training length (zero, not clipped) or the context's pairs, nothing else."""
    import pytest

    from softprior.cells import length_view
    from softprior.config import make_run_config
    from softprior.experiments import Options, _length_evals
    from softprior.model.transformer import build_model
    from softprior.paper import identification_table
    evals = _length_evals(Options(record="identified-assoc_recall"))
    assert [e.name for e in evals] == ["normal", "T=120", "T=120 (no bias beyond)"] and evals[-1].reading == "no bias beyond"
    assert [e.name for e in _length_evals(Options())] == ["normal", "T=120"]
    cfg = make_run_config("assoc_recall", "unforced", 0)
    view, model = length_view(cfg, build_model(cfg), "no bias beyond", 120)
    assert model.cfg.pos_beyond == "zero" and all(b.attn.cfg.pos_beyond == "zero" for b in model.blocks)
    assert view.task == cfg.task
    fill, _ = length_view(cfg, build_model(cfg), "pairs fill", 120)
    assert fill.task.n_pairs > cfg.task.n_pairs
    with pytest.raises(ValueError, match="unknown length reading"):
        length_view(cfg, build_model(cfg), "stretch", 120)
    t = {"length_generalisation": {("soft_bias", "assoc_recall T=120"): 0.59,
                                   ("soft_bias", "assoc_recall T=120 (no bias beyond)"): 0.17}}
    row = next(l for l in identification_table(t, reading="no bias beyond").split("\n") if "T = 120" in l)
    assert "0.170" in row and "read no bias beyond" in row
    del t["length_generalisation"][("soft_bias", "assoc_recall T=120 (no bias beyond)")]
    row = next(l for l in identification_table(t, reading="no bias beyond").split("\n") if "T = 120" in l)
    assert "0.590" in row and "not measured here" in row
