"""What the process-level speed setting buys: one training run with the setting on and off, in turn.

    python benchmarks/speed_machinery.py [REPS] [BASE_STEPS] [LARGE_STEPS] [SETTING:MODEL,...]

Each sample is a whole ``softprior train`` process (1 thread, a sweep worker's setting) into a fresh
temporary store; the figure is the ``seconds`` its summary records (training and evaluation, without
start-up). The settings are process-wide, so on and off cannot share a process: the two alternate,
A B A B, so a drift in the machine's speed falls on both. Models: base and large on assoc recall, base on Markov (BASE_STEPS). Prints, per setting and model, the median
seconds on and off, the ratio off / on pair by pair (median, min, max) and the saving (1 - on / off).

The setting (``runtime.py``): the allocator's trim and mmap thresholds (``SOFTPRIOR_TUNE_MALLOC=0``
turns them off). Flush-to-zero for denormals was measured the same way (``SOFTPRIOR_FLUSH_DENORMALS=0``)
and removed for saving too little (docs/PERFORMANCE.md). Run it on a quiet machine: a sweep beside it
measures nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

SETTINGS = {"allocator": "SOFTPRIOR_TUNE_MALLOC"}
MODELS = {"base": ["--task", "assoc_recall", "--path", "unforced"],
          "large": ["--task", "assoc_recall", "--path", "unforced", "--model", "large"],
          "markov": ["--task", "markov", "--path", "unforced"]}


def one_run(args: list[str], steps: int, env_off: str | None) -> float:
    """Training seconds of one ``softprior train`` process (``env_off``: the variable set to 0)."""
    env = dict(os.environ)
    if env_off:
        env[env_off] = "0"
    with tempfile.TemporaryDirectory() as store:
        out = subprocess.run([sys.executable, "-c", "from softprior.cli import main; main()", "train", *args, "--seed", "0", "--steps", str(steps),
                              "--threads", "1", "--store", store, "--json", "--no-progress", "--exploratory"],
                             env=env, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])


def main(reps: int = 5, base_steps: int = 600, large_steps: int = 120, only: str = "") -> None:
    """``only``: comma-separated "setting:model" pairs to measure (default: every pair)."""
    steps = {"base": base_steps, "large": large_steps, "markov": base_steps}
    print("| setting | model | steps | on (s, median) | off (s, median) | off / on (median, min-max) | saving |")
    print("|---|---|---|---|---|---|---|")
    for name, var in SETTINGS.items():
        for model, args in MODELS.items():
            if only and f"{name}:{model}" not in only.split(","):
                continue
            on, off = [], []
            one_run(args, 20, None)  # warm-up: imports and page cache
            for _ in range(reps):
                on.append(one_run(args, steps[model], None))
                off.append(one_run(args, steps[model], var))
            ratios = sorted(b / a for a, b in zip(on, off))
            m_on, m_off = statistics.median(on), statistics.median(off)
            print(f"| {name} | {model} | {steps[model]} | {m_on:.2f} | {m_off:.2f} | {statistics.median(ratios):.3f} "
                  f"({ratios[0]:.3f}-{ratios[-1]:.3f}) | {1 - m_on / m_off:.1%} |", flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]), *sys.argv[4:5])
