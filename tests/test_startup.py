"""Start-up (issue 30, item 7): ``softprior --help`` and the listings answer without importing torch
(3 s on a quiet machine, ~10 s on a loaded one, for every command). Each check runs in a fresh
interpreter, where nothing has imported torch yet; no clock is read."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

RUN = """
import contextlib, io, json, sys
from softprior.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        rc = main(json.loads(sys.argv[1]))
    except SystemExit as e:  # --help exits from argparse
        rc = e.code
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules, "out": out.getvalue()}))
"""


def fresh(code: str, *args: str) -> dict:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv,shows", [(["--help"], "reproduce"), (["paths"], "fade")], ids=lambda a: str(a))
def test_help_and_paths_do_not_import_torch(argv, shows):
    r = fresh(RUN, json.dumps(argv))
    assert r["rc"] == 0 and shows in r["out"]
    assert not r["torch"], f"softprior {' '.join(argv)} imported torch"


@pytest.mark.parametrize("argv", [["tasks"], ["experiments"]], ids=lambda a: a[0])
def test_listings_do_not_import_torch(argv):
    r = fresh(RUN, json.dumps(argv))
    assert r["rc"] == 0 and r["out"]
    assert not r["torch"], f"softprior {' '.join(argv)} imported torch"


def test_tasks_lists_options_and_the_closed_form_ceiling():
    """``softprior tasks`` names every option with its choices and the associative-recall ceiling of
    the registered default, computed here from the shipped record: E[1/m] = (1-(1-1/K)^n) K/n with
    keys drawn with replacement and the uniform rule, else 1."""
    import softprior.preregistration as rec
    r = fresh(RUN, json.dumps(["tasks"]))
    opts = rec.default_options("assoc_recall")[0]
    K, n = opts.get("n_keys", 15), opts.get("n_pairs", 10)
    want = (1 - (1 - 1 / K) ** n) * K / n if opts.get("keys") == "replacement" and \
        opts.get("repeat_target", "uniform") == "uniform" else 1.0
    line = next(x for x in r["out"].splitlines() if x.startswith("assoc_recall"))
    assert f"ceiling of the default {want:.3f}" in line and f"copying a random value: {1 / n:.3f}" in line
    # the registered value a run uses, the config default beside it where they differ
    assert f"keys={opts.get('keys', 'distinct')!r}" in line and "{distinct|replacement}" in line
    assert "repeat_target=" in line
    for task, field, choices in (("markov", "answer", "{successor|recent}"), ("linear_icl", "format", "{interleaved|paired}")):
        registered = rec.default_options(task)[0]
        line = next(x for x in r["out"].splitlines() if x.startswith(task))
        value = registered.get(field, choices[1:].split("|")[0])  # the registered value, else the config default
        assert f"{field}={value!r}" in line and choices in line, (task, field, value)


def test_import_softprior_is_light_and_its_api_whole():
    """The public names are imported on first use (PEP 562); ``softprior.train`` is the function (the
    training loop's module is ``softprior.training.loop``, so no submodule shadows it)."""
    r = fresh("""
import json, sys, types
import softprior
light = "torch" not in sys.modules
names = {n: type(getattr(softprior, n)).__name__ for n in softprior.__all__}
import softprior.training.loop, softprior.executors.sweep
from softprior import train
print(json.dumps({"light": light, "names": names, "train": callable(train) and callable(softprior.train)
                  and train is softprior.training.loop.train,
                  "module": type(sys.modules["softprior"]).__name__, "dir": sorted(set(softprior.__all__) - set(dir(softprior)))}))
""")
    assert r["light"], "import softprior imported torch"
    assert r["names"]["RunStore"] == "type" and r["names"]["run"] == "function" and r["names"]["train"] == "function"
    assert r["train"] and r["module"] == "module" and r["dir"] == []
