"""The command line, called in-process: ``softprior.cli.main([...])``."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from softprior.cli import main
from softprior.config import make_run_config

STEPS = "20"


def cli(capsys, *argv):
    """Run the CLI; return (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's own refusals (a bad value of a typed option) exit 2, in one line
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny run trained through the CLI: (store dir, summary JSON, stdout, stderr)."""
    store = str(tmp_path_factory.mktemp("cli") / "store")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["train", "--task", "assoc_recall", "--path", "unforced", "--seed", "0", "--steps", STEPS,
                   "--store", store, "--json", "--no-progress"])
    assert rc == 0, err.getvalue()
    return store, last_json(out.getvalue()), out.getvalue(), err.getvalue()


def assert_usage_error(rc, out, err, *must_name):
    assert rc == 2
    assert "Traceback" not in err and "Traceback" not in out
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1, err
    for s in must_name:
        assert s in lines[0], (s, lines[0])


# ------------------------------------------------------------------ train
def test_train_json(trained):
    store, s, out, err = trained
    for k in ("run_id", "normal_acc", "zero_acc", "steps", "seconds"):
        assert k in s, k
    assert s["steps"] == 20
    assert 0.0 <= s["normal_acc"] <= 1.0 and 0.0 <= s["zero_acc"] <= 1.0
    # the CLI builds the same config as the Python API
    assert s["run_id"] == make_run_config("assoc_recall", "unforced", 0, steps=20).run_id
    assert not s.get("cached")
    # with --json the human-readable header goes to stderr, so stdout is only the JSON line
    assert len(out.strip().splitlines()) == 1
    assert s["run_id"] in err


def test_train_second_call_is_cached(trained, capsys):
    store, first, _, _ = trained
    rc, out, err = cli(capsys, "train", "--task", "assoc_recall", "--path", "unforced", "--seed", "0",
                       "--steps", STEPS, "--store", store, "--json", "--no-progress")
    assert rc == 0
    second = last_json(out)
    assert second.get("cached") is True
    assert "already in store" in err
    for k in ("run_id", "normal_acc", "zero_acc", "normal_loss", "zero_loss", "steps", "seconds"):
        assert second[k] == first[k], k


def test_train_human_output(tmp_path, capsys):
    rc, out, err = cli(capsys, "train", "--path", "forced_zero", "--steps", "5", "--store", str(tmp_path / "s"),
                       "--no-progress")
    assert rc == 0
    assert "normal acc" in out and "zero-gate acc" in out
    assert make_run_config("assoc_recall", "forced_zero", 0, steps=5).run_id in out


def test_train_other_tasks(tmp_path, capsys):
    rc, out, _ = cli(capsys, "train", "--task", "linear_icl", "--path", "fade600", "--steps", "5",
                     "--store", str(tmp_path / "s"), "--json", "--no-progress")
    assert rc == 0
    s = last_json(out)
    assert s["metric"] == "mse" and "normal_mse" in s and "zero_mse" in s


# ------------------------------------------------------------------ eval
def _by_hand(store, run_id, length, g_pos, g_content):
    """Accuracy and loss of a stored run computed independently of ``softprior eval``: the weights
    read straight from final.safetensors into the readable model, every position computed, the
    answer read at the last one, cross-entropy and argmax written out here."""
    import torch
    from safetensors.torch import load_file

    from softprior.config import RunConfig
    from softprior.model.transformer import SoftPriorTransformer
    from softprior.tasks.generators import make_task

    d = __import__("pathlib").Path(store) / "runs" / run_id
    cfg = RunConfig.model_validate_json((d / "config.json").read_text())
    model = SoftPriorTransformer(cfg.model)
    model.load_state_dict(load_file(str(d / "final.safetensors")))
    val = make_task(cfg.task).sample(cfg.n_val, length, torch.Generator().manual_seed(cfg.val_seed))
    with torch.no_grad():
        logits = model(val.inputs, g_pos, g_content)[:, -1]  # [n_val, vocab]
    logp = logits - logits.logsumexp(-1, keepdim=True)
    loss = -logp.gather(1, val.targets[:, None]).mean()
    acc = (logits.argmax(-1) == val.targets).float().mean()
    return float(acc), float(loss), cfg


def test_eval_zero_gates_at_length_120(trained, capsys):
    store, s, _, _ = trained
    rc, out, _ = cli(capsys, "eval", s["run_id"], "--gates", "pos=0,content=0", "--length", "120",
                     "--store", store, "--json")
    assert rc == 0
    e = last_json(out)
    assert e["run_id"] == s["run_id"] and e["length"] == 120
    assert e["g_pos"] == 0.0 and e["g_content"] == 0.0
    acc, loss, cfg = _by_hand(store, s["run_id"], 120, 0.0, 0.0)
    assert e["metric"] == "acc"
    assert abs(e["acc"] - acc) <= 1.0 / cfg.n_val  # at most one near-tie flipped by rounding
    assert e["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert e["chance"] == pytest.approx(1.0 / cfg.task.n_pairs)
    # and these are not the training-length numbers (so a --length that is ignored would fail here)
    _, loss32, _ = _by_hand(store, s["run_id"], 32, 0.0, 0.0)
    assert abs(loss32 - loss) > 1e-4


def test_eval_reproduces_training_numbers(trained, capsys):
    """At the training length, eval with zero gates gives the run's zero-gate accuracy, and with the
    model's own gates its normal accuracy (same fixed validation set)."""
    store, s, _, _ = trained
    rc, out, _ = cli(capsys, "eval", s["run_id"], "--gates", "pos=0,content=0", "--store", store, "--json")
    assert rc == 0 and last_json(out)["acc"] == pytest.approx(s["zero_acc"])
    rc, out, _ = cli(capsys, "eval", s["run_id"], "--store", store, "--json")
    e = last_json(out)
    assert rc == 0 and e["acc"] == pytest.approx(s["normal_acc"])
    assert e["length"] == 32
    assert e["g_pos"] == pytest.approx(s["model_g_pos"]) and e["g_content"] == pytest.approx(s["model_g_content"])


def test_eval_one_gate_and_prefix(trained, capsys):
    store, s, _, _ = trained
    rc, out, _ = cli(capsys, "eval", s["run_id"][:8], "--gates", "pos=0", "--store", store, "--json")
    e = last_json(out)
    assert rc == 0 and e["run_id"] == s["run_id"]
    assert e["g_pos"] == 0.0 and e["g_content"] == pytest.approx(s["model_g_content"])


def test_eval_human_output(trained, capsys):
    store, s, _, _ = trained
    rc, out, _ = cli(capsys, "eval", s["run_id"], "--gates", "pos=0,content=0", "--store", store)
    assert rc == 0 and s["run_id"] in out and "length 32" in out


# ------------------------------------------------------------------ listings
def test_paths_lists_names(capsys):
    rc, out, _ = cli(capsys, "paths")
    assert rc == 0
    for name in ("unforced", "forced_zero", "forced_const0.5", "linear0.5->0", "posthoc", "fadeS->0",
                 "hard_switchS", "prior_dropout"):
        assert name in out, name


def test_tasks_lists_names(capsys):
    rc, out, _ = cli(capsys, "tasks")
    assert rc == 0
    for name in ("assoc_recall", "markov", "linear_icl"):
        assert name in out


def test_tasks_shows_the_registered_values_a_run_uses(capsys):
    """The options a run gets (the shipped pre-registered calibration), not the config defaults."""
    from softprior.preregistration import default_options
    rc, out, _ = cli(capsys, "tasks")
    assert rc == 0
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    for task in ("assoc_recall", "markov", "linear_icl"):
        cfg = make_run_config(task).task  # what `softprior train --task TASK` trains on
        registered, _ = default_options(task)
        assert registered, task
        for key in registered:
            assert f"{key}={getattr(cfg, key)!r}" in lines[task], (task, key)
    # the registered associative recall: 6 pairs, 10 keys drawn with replacement, one pool of tokens
    ar = lines["assoc_recall"]
    assert "n_pairs=6 (default 10)" in ar and "keys='replacement' (default 'distinct')" in ar
    assert "layout='pool' (default 'disjoint')" in ar and "vocab=32," in ar  # an unchanged one: no default beside


# ------------------------------------------------------------------ bad input: exit 2, one line, no traceback
@pytest.mark.parametrize("args,named", [
    (["--task", "sorting"], ["sorting", "assoc_recall"]),
    (["--path", "bogus_path"], ["bogus_path", "unforced"]),
    (["--path", "fade600->0:sine"], ["sine", "cosine"]),
    (["--path", "forced_const1.5"], ["1.5"]),
    (["--model", "huge"], ["huge", "base"]),
    (["--steps", "-1"], ["-1", "--steps"]),
    (["--steps", "0"], ["--steps"]),
    (["--seed", "-3"], ["seed", "-3"]),
    # an unknown task option lists the valid ones
    (["--task-opt", "n_pair=4"], ["'n_pair'", "assoc_recall", "n_pairs", "n_keys", "repeat_target"]),
    (["--task", "markov", "--task-opt", "n_pairs=3"], ["'n_pairs'", "markov", "p, vocab, loss_on, query, answer"]),
])
def test_train_bad_input(tmp_path, capsys, args, named):
    rc, out, err = cli(capsys, "train", *args, "--store", str(tmp_path / "s"), "--json", "--no-progress")
    assert_usage_error(rc, out, err, *named)
    assert not (tmp_path / "s" / "runs").exists() or not any((tmp_path / "s" / "runs").iterdir())


@pytest.mark.parametrize("gates,named", [
    ("pos", ["pos"]),
    ("foo=0", ["foo", "pos", "content"]),
    ("pos=2", ["pos", "2"]),
    ("pos=-0.5", ["pos", "-0.5"]),
    ("pos=abc", ["abc"]),
    ("pos=0,content", ["content"]),
    ("pos=0,pos=1", ["'pos' is given twice", "pos=0,pos=1"]),  # was accepted, the last one winning
    ("content=", ["''", "content="]),
])
def test_eval_bad_gates(trained, capsys, gates, named):
    store, s, _, _ = trained
    rc, out, err = cli(capsys, "eval", s["run_id"], "--gates", gates, "--store", store, "--json")
    assert_usage_error(rc, out, err, *named)


def test_eval_unknown_run_id(trained, capsys):
    store, _, _, _ = trained
    rc, out, err = cli(capsys, "eval", "feedfacefeedface", "--store", store, "--json")
    assert_usage_error(rc, out, err, "feedfacefeedface")


def test_eval_length_too_short(trained, capsys):
    store, s, _, _ = trained
    rc, out, err = cli(capsys, "eval", s["run_id"], "--length", "5", "--store", store)
    assert_usage_error(rc, out, err, "5")


# Regression: cmd_eval uses `args.length or n_ctx`, so --length 0
# silently evaluates at the training length instead of being rejected
def test_eval_length_zero_is_rejected(trained, capsys):
    store, s, _, _ = trained
    rc, out, err = cli(capsys, "eval", s["run_id"], "--length", "0", "--store", store, "--json")
    assert_usage_error(rc, out, err, "0")


@pytest.mark.parametrize("command", ["reproduce", "report"])
@pytest.mark.parametrize("tasks,bad", [("assoc_recal", "assoc_recal"), ("linear_icl,sorting", "sorting"),
                                       ("markov p=0.3", "markov p=0.3")])
def test_unknown_task_filter_is_a_usage_error(tmp_path, capsys, command, tasks, bad):
    """An unknown name in --tasks used to select nothing and print an empty table."""
    rc, out, err = cli(capsys, command, "static_baselines", "--quick", "--tasks", tasks,
                       "--store", str(tmp_path / "s"), "--out", str(tmp_path / "out"),
                       *(["--no-progress"] if command == "reproduce" else []))
    assert_usage_error(rc, out, err, repr(bad), "--tasks", "assoc_recall", "markov p=0.2")
    assert err.startswith("softprior: error: ")
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "s" / "runs").exists() or not any((tmp_path / "s" / "runs").iterdir())


def test_known_task_filters_are_accepted():
    from softprior.experiments import Options, get_experiment
    cells = get_experiment("static_baselines").build(Options(quick=True, seeds=1, tasks=("markov", "linear_icl")))
    assert {c.col for c in cells} == {"markov p=0.2", "markov p=0.5", "markov p=0.8", "linear_icl"}
    cells = get_experiment("static_baselines").build(Options(quick=True, seeds=1, tasks=("markov p=0.5",)))
    assert {c.col for c in cells} == {"markov p=0.5"}


def test_group_help_describes_the_engine_not_vmap(capsys):
    with pytest.raises(SystemExit):
        main(["reproduce", "--help"])
    out = capsys.readouterr().out
    options = out[out.index("  --group GROUP"):]
    group_help = " ".join(options[:options.index("--address ADDRESS")].split())  # argparse wraps lines
    assert "vmap" not in group_help and "run dimension" in group_help


def test_unwritable_store(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    bad = str(blocker / "store")
    rc, out, err = cli(capsys, "train", "--steps", STEPS, "--store", bad, "--json", "--no-progress")
    assert_usage_error(rc, out, err, bad)
    rc, out, err = cli(capsys, "eval", "0123abcd", "--store", bad)
    assert_usage_error(rc, out, err, bad)


def test_missing_positional_run_id_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["eval"])
    assert ei.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_bench_json_reports_the_issue_figures(capsys):
    """A smoke run of the benchmark (figures are printed, never asserted on beyond being positive)."""
    assert main(["bench", "--quick", "--json", "--group", "2", "--sweep", "2", "--sweep-steps", "20"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("gemm_gflops", "single_ms_per_step", "group_ms_per_run_step", "reference_ms_per_step", "mfu",
                "large_single_ms_per_step", "large_reference_ms_per_step"):
        assert res[key] > 0, key
    assert res["speedup_large"] == pytest.approx(
        res["large_reference_ms_per_step"] / res["large_single_ms_per_step"], rel=1e-2)
    assert res["speedup_single"] == pytest.approx(res["reference_ms_per_step"] / res["single_ms_per_step"], rel=1e-2)
    assert res["sweep_runs"] == 2 and res["sweep_reference_seconds"] == pytest.approx(
        2 * 20 * res["reference_ms_per_step"] / 1e3, rel=1e-2)
    assert res["sweep_ratio"] == pytest.approx(res["sweep_seconds"] / res["sweep_reference_seconds"], rel=1e-2)
    # the group scaling is measured, saved where --group auto reads it, and read back as measured
    from softprior.executors.grouping import load_group_scaling
    assert load_group_scaling() == {int(k): v for k, v in res["group_scaling_ms"].items()}
    assert set(load_group_scaling()) == {1, 2, 4, 8}
    # the large model's table is measured too; a --quick one (3 steps) is shown, not saved
    assert set(res["group_scaling_large_ms"]) == {"1", "2"} and all(v > 0 for v in res["group_scaling_large_ms"].values())
    assert load_group_scaling("large") is None
    # the fused engine against the attention operator alone, the engine without either and the reference
    # (--quick: base, K = 1 and 2, 1 thread); a fraction of the GEMM rate counts the model's FLOP, which
    # the engine does not all perform (docs/PERFORMANCE.md, section 2), so it may pass 1
    from softprior.kernels import attention_backend, step
    assert res["attention_backend"] == attention_backend() == res["engines"]["attention_backend"]
    assert res["engines"]["step_operator"] == step.enabled()
    for K in ("K1", "K2"):
        row = res["engines"]["base"]["1"][K]
        assert row["fused_ms"] > 0 and row["attention_ms"] > 0 and row["torch_ms"] > 0 and row["fused_gemm_fraction"] > 0
        assert row["fused_gemm_fraction"] / row["torch_gemm_fraction"] == pytest.approx(row["fused_vs_torch"], rel=1e-2)
        assert row["fused_vs_torch"] == pytest.approx(row["torch_ms"] / row["fused_ms"], rel=1e-2)
        assert row["fused_vs_attention"] == pytest.approx(row["attention_ms"] / row["fused_ms"], rel=1e-2)
        assert row["fused_vs_reference"] == pytest.approx(row["reference_ms"] / row["fused_ms"], rel=1e-2)


def test_reproduce_rejects_an_unusable_device(tmp_path, capsys):
    assert main(["reproduce", "removability", "--quick", "--store", str(tmp_path / "s"), "--device", "cuda:7",
                 "--group", "2", "--no-progress"]) != 0
    assert "--device 'cuda:7'" in capsys.readouterr().err
    # the whole paper honours --device too (it used to skip the check and train on the CPU)
    assert main(["reproduce", "paper", "--quick", "--store", str(tmp_path / "s"), "--device", "cuda:7",
                 "--no-progress", "--out", str(tmp_path / "never")]) != 0
    assert "--device 'cuda:7'" in capsys.readouterr().err and not (tmp_path / "never").exists()


@pytest.mark.parametrize("command", ["reproduce", "report"])
def test_paper_with_no_workers_is_a_usage_error(tmp_path, capsys, command):
    rc, out, err = cli(capsys, command, "paper", "--quick", "--workers", "0", "--store", str(tmp_path / "s"),
                       "--out", str(tmp_path / "out"), *(["--no-progress"] if command == "reproduce" else []))
    assert_usage_error(rc, out, err, "--workers", "0")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ errors: ours in one line, anything else a traceback
def assert_failure(rc, out, err, *must_name):
    """A failure our code found and explains: one line, exit code 1."""
    assert rc == 1
    assert "Traceback" not in err and "Traceback" not in out
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("softprior: error: "), err
    for s in must_name:
        assert s in lines[0], (s, lines[0])


@pytest.mark.parametrize("exc", [RuntimeError("boom in torch"), KeyError("boom"), ValueError("boom"),
                                 ImportError("boom"), AttributeError("boom")], ids=lambda e: type(e).__name__)
def test_a_bug_shows_its_traceback_and_exit_code_1(monkeypatch, capsys, exc):
    """cli.main used to catch RuntimeError, KeyError, ValueError and ImportError around every command,
    so a bug in torch or in our code read as a one-line user error with exit code 2."""
    import softprior.paths

    def broken():
        raise exc
    monkeypatch.setattr(softprior.paths, "list_paths", broken)
    rc, out, err = cli(capsys, "paths")
    assert rc == 1
    assert "Traceback (most recent call last)" in err and "boom" in err and "list_paths" in err
    assert err.strip().splitlines()[-1].startswith(f"softprior: unexpected {type(exc).__name__}")


def test_a_bug_during_eval_is_not_a_usage_error(trained, monkeypatch, capsys):
    import importlib
    store, s, _, _ = trained

    def broken(*a, **k):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x64 and 32x64)")
    monkeypatch.setattr(importlib.import_module("softprior.training.loop"), "evaluate", broken)
    rc, out, err = cli(capsys, "eval", s["run_id"], "--store", store)
    assert rc == 1 and "Traceback" in err and "mat1 and mat2" in err


@pytest.mark.parametrize("command", [["eval", "0123abcd"], ["export", "0123abcd"], ["report", "removability", "--quick"],
                                     ["store", "verify"]], ids=lambda c: c[0])
def test_a_typo_in_store_is_an_error_not_a_new_store(tmp_path, capsys, command):
    """Reading a store that is not there used to create an empty one (and report printed an empty table)."""
    typo = tmp_path / "rnus"
    out_dir = {"report": ["--out", str(tmp_path / "o")], "export": ["--out", str(tmp_path / "o.safetensors")]}
    rc, out, err = cli(capsys, *command, "--store", str(typo), *out_dir.get(command[0], []))
    assert_usage_error(rc, out, err, "no run store", str(typo), "check --store")
    assert not typo.exists() and not any(tmp_path.iterdir())


def test_an_unreadable_run_points_at_store_verify(trained, tmp_path, capsys):
    """It said "checkpoint does not match its config", with exit code 2, as if the input were wrong."""
    import shutil
    store, s, _, _ = trained
    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    (copy / "runs" / s["run_id"] / "final.safetensors").write_bytes(b"\0" * 100)
    for command in (["eval", s["run_id"]], ["export", s["run_id"], "--out", str(tmp_path / "x.safetensors")]):
        rc, out, err = cli(capsys, *command, "--store", str(copy))
        assert_failure(rc, out, err, s["run_id"], f"`softprior store verify --store {str(copy)!r}`")


def test_eval_at_a_length_beyond_memory_is_a_limit_not_an_allocator_error(trained, capsys):
    """--length 100000 printed torch's raw allocator error."""
    store, s, _, _ = trained
    rc, out, err = cli(capsys, "eval", s["run_id"], "--length", "100000", "--store", store)
    assert_usage_error(rc, out, err, "--length 100000", "GiB", "the longest length that fits is about")
    longest = int(err.rsplit("about", 1)[1].replace(",", "").strip())
    assert 120 < longest < 100000


def test_eval_beyond_a_learned_position_table_is_refused(tmp_path, capsys):
    rc, out, _ = cli(capsys, "train", "--baseline", "vanilla", "--steps", "3", "--store", str(tmp_path / "s"),
                     "--json", "--no-progress", "--exploratory")
    assert rc == 0
    rid = last_json(out)["run_id"]
    rc, out, err = cli(capsys, "eval", rid, "--length", "500", "--store", str(tmp_path / "s"))
    assert_usage_error(rc, out, err, "--length 500", "position table", "the longest it can evaluate is 128")


@pytest.mark.parametrize("flag,kind", [("--out", "file"), ("--doc", "dir"), ("--doc", "missing parent"),
                                       ("--out", "under a file")])
def test_report_outputs_that_cannot_be_written_are_one_line_errors(trained, tmp_path, capsys, flag, kind):
    """report --out FILE and --doc DIR ended in tracebacks (FileExistsError, IsADirectoryError)."""
    store, _, _, _ = trained
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    value = {"file": tmp_path / "a_file", "dir": tmp_path / "a_dir", "missing parent": tmp_path / "no" / "doc.md",
             "under a file": tmp_path / "a_file" / "out"}[kind]
    args = ["report", "removability", "--quick", "--store", store, flag, str(value)]
    if flag == "--doc":
        args += ["--out", str(tmp_path / "out")]
    rc, out, err = cli(capsys, *args)
    assert_usage_error(rc, out, err, flag, str(value))
    assert not (tmp_path / "out").exists() and not (tmp_path / "no").exists()


def test_export_into_a_missing_directory_creates_it_and_under_a_file_is_refused(trained, tmp_path, capsys):
    store, s, _, _ = trained
    out = tmp_path / "new" / "dir" / "m.safetensors"
    rc, _, err = cli(capsys, "export", s["run_id"], "--out", str(out), "--store", store)
    assert rc == 0 and out.is_file(), err
    (tmp_path / "a_file").write_text("x")
    rc, o, err = cli(capsys, "export", s["run_id"], "--out", str(tmp_path / "a_file" / "m.safetensors"), "--store", store)
    assert_usage_error(rc, o, err, "--out", "a_file", "is a file, not a directory")


def test_ray_executor_without_ray_is_said_before_anything_runs(tmp_path, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    rc, out, err = cli(capsys, "reproduce", "removability", "--quick", "--executor", "ray", "--no-progress",
                       "--store", str(tmp_path / "s"), "--out", str(tmp_path / "o"))
    assert_usage_error(rc, out, err, "--executor ray", "pip install 'softprior[ray]'")
    assert not (tmp_path / "o").exists()


def test_python_m_softprior_cli_reports_our_errors_in_one_line(tmp_path):
    """``python -m softprior.cli`` (how the tests and a sweep's workers start the CLI) sorts errors as the
    ``softprior`` command does: a CliError is one line and exit 2, not a traceback of an unexpected
    error (the module run as __main__ is a second copy, with a CliError of its own)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "softprior.cli", "report", "timings", "--store", str(tmp_path / "s"),
                        "--until", "last week"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "--until must be an ISO 8601 time" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_cached_rerun_draws_no_empty_bar_and_wrote_names_every_file(tmp_path, capsys):
    """`reproduce NAME` again on a full store: no sweep bar at 0/0 run-steps, and the "wrote" line names
    every file the report wrote (curves.png and formation.csv too), the first time and the second."""
    plugin = tmp_path / "rerun.py"
    plugin.write_text("from softprior.cells import Cell\n"
                      "from softprior.experiments import Experiment, register_experiment\n"
                      "from softprior.config import make_run_config\n"
                      "register_experiment(Experiment('rerun_demo', 'two paths', lambda o: "
                      "[Cell(make_run_config('assoc_recall', p, 0, steps=12, eval_every=6, n_val=32, batch_size=8, "
                      "calibrated=False), row=p) for p in ('unforced', 'forced_zero')], curves=True))\n")
    argv = ["reproduce", "rerun_demo", "--plugin", str(plugin), "--store", str(tmp_path / "s"), "--out",
            str(tmp_path / "out"), "--exploratory"]
    for attempt in ("trains", "cached"):
        rc, _, err = cli(capsys, *argv)
        assert rc == 0, err
        assert ("sweep:" in err) == (attempt == "trains"), err  # the bar only when something trains
        wrote = next(line for line in err.splitlines() if line.startswith("wrote "))
        named = set(wrote.split(": ", 1)[1].split(", "))
        on_disk = {p.name for p in (tmp_path / "out").iterdir()}
        assert named == on_disk and {"curves.png", "formation.csv", "figure.png"} <= named, (wrote, on_disk)


def test_reproduce_an_experiment_on_another_record(tmp_path, capsys):
    """``reproduce NAME --record R``: the runs and the table are the record's configuration (the
    identified set's best: a prior on both layers); an unknown record is one line naming the shipped ones."""
    from softprior.store import RunStore
    out, store = tmp_path / "out", tmp_path / "runs"
    assert main(["reproduce", "gate_interventions", "--quick", "--record", "identified-assoc_recall", "--store",
                 str(store), "--out", str(out), "--no-progress", "--workers", "1", "--exploratory"]) == 0
    s = RunStore(store)
    cfgs = [s.load_config(r["run_id"]) for r in s.rows()]
    assert cfgs and all(c.model.prior_layers == (0, 1) and c.model.content_rank == 0 for c in cfgs)
    assert (out / "table.md").is_file()
    capsys.readouterr()
    assert main(["reproduce", "gate_interventions", "--quick", "--record", "nope", "--store", str(store)]) == 2
    assert "identified-assoc_recall" in capsys.readouterr().err


def test_reproduce_paper_only_names_the_experiments_it_may_run(tmp_path, capsys):
    """--only keeps some of the paper's experiments; a name that is not one of them is refused in one
    line that lists them (before anything trains)."""
    from softprior.cli import main
    assert main(["reproduce", "paper", "--only", "paths,nope", "--store", str(tmp_path / "s"), "--out",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--only: 'nope' not among the experiments" in err and "removability" in err
    assert not (tmp_path / "s").exists()
