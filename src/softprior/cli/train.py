"""``softprior train`` (one run) and ``softprior eval`` (a stored run under gate overrides)."""

from __future__ import annotations

import json
import os
import sys
import time

from .common import CliError, _store, parse_gates, parse_options


def _print_result(summary: dict, as_json: bool, extra_lines=()):
    m = summary.get("metric", "acc")
    if not as_json:
        for line in extra_lines:
            print(line)
        print(f"normal {m}: {summary[f'normal_{m}']:.4f}   zero-gate {m}: {summary[f'zero_{m}']:.4f}   "
              f"(chance {summary.get('chance', float('nan')):.3f})")
    else:
        print(json.dumps(summary, sort_keys=True))


def cmd_train(args) -> int:
    import torch

    from ..config import make_run_config
    from ..experiments import PAPER_STEPS
    from ..paths import fits_budget, scale_to_budget, settles_at
    from ..executors.sweep import run
    from ..training.runtime import choose_threads
    from ..model.transformer import build_model

    if args.threads is not None and args.threads < 1:
        raise CliError(f"--threads must be a positive integer, got {args.threads}")
    cfg = make_run_config(args.task, args.path, args.seed, model=args.model, steps=args.steps,
                          baseline=args.baseline, task_options=parse_options(args.task_opt),
                          **({"checkpoint_every": args.checkpoint_every} if args.checkpoint_every else {}))
    note = None
    if not fits_budget(cfg.path, cfg.steps):
        # fade600 on 200 steps would never fade: its schedule is scaled to the budget as --quick scales
        # it, under a name that says so (stored in the run's summary) and a label that says why
        named = cfg.path
        path = scale_to_budget(named, cfg.steps, PAPER_STEPS)
        why = f"{named.name} settles at step {settles_at(named)}, after the run's {cfg.steps} steps"
        cfg = cfg.model_copy(update={"path": path, "label": f"{path.description} ({why})"})
        note = (f"{why}: scaled x{cfg.steps / PAPER_STEPS:.4g} as --quick does, stored as {path.name!r} "
                f"({path.description.split(': ', 1)[1]})")
    threads, chosen = (args.threads, "--threads") if args.threads else choose_threads()
    torch.set_num_threads(threads)
    store = _store(args)
    n_params = build_model(cfg).n_params()
    was_done = store.is_done(cfg.run_id)
    header = sys.stderr if args.json else sys.stdout
    if note:
        print(note, file=header)
    print(f"run {cfg.run_id}: task={cfg.task.name} path={cfg.path.name} seed={cfg.seed} "
          f"model={args.model} params={n_params:,} steps={cfg.total_steps} threads={threads} ({chosen})"
          + ("  [already in store: not retrained]" if was_done else ""), file=header)
    t0 = time.perf_counter()
    summary = dict(run(cfg, store, progress=not args.no_progress, require_calibration=not args.exploratory))
    if was_done:
        summary["cached"] = True
    if cfg.label:
        summary["label"] = cfg.label
    summary.setdefault("seconds", round(time.perf_counter() - t0, 3))
    _print_result(summary, args.json)
    return 0


def _check_length(length: int, cfg, model) -> None:
    """--length against what the run's model can hold: a learned position table's rows, and memory:
    one layer's attention over the validation set holds about three [n_val, heads, T, T] tensors
    (measured: 2.1 at T = 512 and 1024), refused beyond this machine's memory rather than left to the
    allocator's error."""
    rows = [m.max_len for m in model.modules() if isinstance(getattr(m, "max_len", None), int)]
    if rows and length > min(rows):
        raise CliError(f"--length {length} is longer than run {cfg.run_id}'s {cfg.model.positional} position table "
                       f"({min(rows)} rows); the longest it can evaluate is {min(rows)}")
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: the allocator decides
        return
    per = 3 * cfg.n_val * cfg.model.n_heads * next(model.parameters()).element_size()  # bytes per T^2
    if per * length ** 2 > have:
        raise CliError(f"--length {length} needs about {per * length ** 2 / 2 ** 30:,.0f} GiB for the attention of "
                       f"{cfg.n_val} validation sequences; this machine has {have / 2 ** 30:,.0f} GiB: the longest "
                       f"length that fits is about {int((have / per) ** 0.5):,}")


def cmd_eval(args) -> int:
    import torch

    from ..tasks.generators import make_task
    from ..training.loop import evaluate

    gp, gc = parse_gates(args.gates)
    store = _store(args, read_only=True)
    cfg, model = store.load_model(args.run_id)
    task = make_task(cfg.task)
    length = cfg.model.n_ctx if args.length is None else args.length
    if length < task.min_length():
        raise CliError(f"--length {length} is too short for {cfg.task.name}; minimum {task.min_length()}")
    _check_length(length, cfg, model)
    val = cfg.validation_batch(task, length=length)
    with torch.no_grad():
        res = evaluate(model, task, val.inputs, val.targets, gp, gc)
        g_pos, g_content = model.gates(gp, gc)
    out = {"run_id": cfg.run_id, "metric": task.metric, task.metric: res[task.metric], "loss": res["loss"],
           "length": length, "g_pos": float(g_pos.mean()), "g_content": float(g_content.mean()),
           "chance": task.chance_at(length)}
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(f"run {cfg.run_id} ({cfg.task.name}, {cfg.path.name}, seed {cfg.seed}) at length {length}, "
              f"g_pos={out['g_pos']:.3f} g_content={out['g_content']:.3f}: "
              f"{task.metric} {res[task.metric]:.4f}, loss {res['loss']:.4f} (chance {out['chance']:.3f})")
    return 0


def _add_train_parser(sub) -> None:
    """``softprior train``: one run."""
    t = sub.add_parser("train", help="train one run (skipped if already in the store)")
    t.add_argument("--task", default="assoc_recall")
    t.add_argument("--path", default="fade600")
    t.add_argument("--baseline", default=None, help="a static baseline (see `softprior baselines`); sets the path")
    t.add_argument("--task-opt", action="append", metavar="KEY=VALUE",
                   help="task option, e.g. p=0.2 (markov) or n_pairs=12 (assoc_recall); repeatable")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--model", default="base", help="one of {model_presets}")
    t.add_argument("--steps", type=int, default=None, help="step budget (default 3600); a path whose schedule "
                   "settles later (fade600->0 ends at step 1050) is scaled to it as --quick does, and named so")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: the free cores, "
                   "runtime.choose_threads)")
    t.add_argument("--checkpoint-every", type=int, default=0, help="steps between resumable checkpoints")
    t.add_argument("--store", default="runs")
    t.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--exploratory", action="store_true",
                   help="train a prediction row even if no calibration record covers its configuration")
    t.set_defaults(fn=cmd_train)


def _add_eval_parser(sub) -> None:
    """``softprior eval``: a stored run under gate overrides."""
    e = sub.add_parser("eval", help="evaluate a stored run under a gate override")
    e.add_argument("run_id")
    e.add_argument("--gates", default=None, help="e.g. pos=0,content=0 (missing gates keep the model's)")
    e.add_argument("--length", type=int, default=None, help="sequence length (default: the training context)")
    e.add_argument("--store", default="runs")
    e.add_argument("--json", action="store_true")
    e.set_defaults(fn=cmd_eval)
