"""Property-based tests (Hypothesis): malformed command lines, path files and plugin files.

Every malformed input must get exactly one line on stderr, ``softprior: error: ...``, that names the
bad value (or the bad file), exit code 2, no traceback, and leave the run store byte-for-byte as it
was.

What is valid is written down here (``SPEC``: the README's and the paper's ranges and names), not
asked of the library: a strategy draws a value this description calls invalid, so a validator that
was loosened (a gate of 7 accepted) fails here instead of shrinking the set of inputs tried. 200
examples per property; every command tried is refused before any training or evaluation starts (a
loosened validator would train: the test then fails on its exit code).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from softprior.cli import main

SETTINGS = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# ------------------------------------------------------------------------------ SPEC: what is valid
COMMANDS = {"train", "eval", "reproduce", "report", "calibrate", "experiments", "baselines", "bench", "export",
            "store", "paths", "tasks", "tour", "study", "atlas"}
TASKS = {"assoc_recall", "markov", "linear_icl"}
TASK_FILTERS = TASKS | {"markov p=0.2", "markov p=0.5", "markov p=0.8"}  # --tasks: a task or a Markov variant
MODELS = {"base", "large"}
BASELINES = {"vanilla", "nope", "rope", "alibi", "t5", "dape", "cope", "fire", "kerple", "gpsa", "soft_bias",
             "soft_pos_only", "soft_content_only", "kerple_log", "kerple_power"}  # the thirteen, two kerple spellings
EXPERIMENTS = {"removability", "paths", "causal_controls", "fade_window", "fade_shapes", "markov_paths", "linear_paths",
               "extra_controls", "static_baselines", "gate_interventions", "length_generalisation",
               "mechanism_trace", "late_fade", "mechanism_trace_late", "mechanism_trace_large", "continuation_trace",
               "continuation_trace_large", "paper"}
EXECUTORS = {"local", "ray"}
FORMATS = {"transformer-lens"}
ASSOC_RECALL_OPTIONS = {"n_pairs", "vocab", "n_keys", "layout", "n_queries", "loss_on", "placement", "keys",
                        "repeat_target"}
NAMED_PATHS = {"unforced", "forced_zero", "forced_const0.5", "linear0.5->0", "prior_dropout", "dual_loss", "posthoc"}
FADE_SHAPES = {"linear", "cosine", "convex", "concave", "two_step"}
GATE_KEYS = {"pos", "content"}
PATH_FIELDS = {"name", "description", "pos", "content", "prior_dropout", "dual_loss", "parent", "parent_steps", "steps"}
GATE_MODES = {"learned", "fixed", "scheduled"}
SCHEDULE_KINDS = {"constant", "linear", "fade", "hard_switch"}
SHORTEST = 3  # no task answers with fewer tokens than a key, a value and a query
LONGEST = 10 ** 7  # no machine holds the attention of 512 sequences this long (~10^17 bytes)


def is_int(s: str) -> bool:
    """An integer as argparse's type=int reads it (Python's int(), the documented contract)."""
    try:
        int(s)
    except ValueError:
        return False
    return True


def number(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def valid_gates(text: str) -> bool:
    """--gates: comma-separated KEY=VALUE, KEY pos or content (each at most once), VALUE a number in
    [0, 1] or 'model'/'learned' (the model's own gate); spaces around either are ignored. Empty: none."""
    if text == "":
        return True
    seen = set()
    for item in text.split(","):
        if "=" not in item:
            return False
        k, v = (s.strip() for s in item.split("=", 1))
        if k not in GATE_KEYS or k in seen:
            return False
        seen.add(k)
        if v in ("model", "learned"):
            continue
        x = number(v)
        if x is None or not 0.0 <= x <= 1.0:
            return False
    return True


def maybe_valid_path(name: str) -> bool:
    """--path, conservatively: a named path, a file, or anything in the parametrised families
    (fadeS->0[:shape], hard_switchS, forced_constC, prior_dropoutF) — their invalid members are drawn
    by ``bad_family_path`` with the ranges written there."""
    if name in NAMED_PATHS or name.endswith((".json", ".toml")):
        return True
    try:
        if os.path.exists(name):
            return True
    except ValueError:  # a NUL byte
        pass
    return bool(re.match(r"(fade|hard_switch|switch|forced_const|prior_dropout)", name))


# printable-or-not text without lone surrogates (argv decoded by Python never has them unpaired
# except through surrogateescape, which stderr's backslashreplace handles; StringIO does not)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=16)
NOT_INT = TEXT.filter(lambda s: not is_int(s))
NEGATIVE = st.integers(max_value=-1).map(str)
NON_POSITIVE = st.integers(max_value=0).map(str)


def not_in(names: set[str]):
    return TEXT.filter(lambda s: s not in names)


OUT_OF_UNIT = st.one_of(st.floats(allow_nan=False).filter(lambda x: not 0.0 <= x <= 1.0).map(repr),
                        st.sampled_from(["nan", "inf", "-inf", "1.5", "7", "-0.5", "2"]))
GATE_ITEM_BAD = st.one_of(
    st.tuples(st.sampled_from(sorted(GATE_KEYS)), OUT_OF_UNIT).map("=".join),  # pos=7
    st.tuples(not_in(GATE_KEYS).filter(lambda k: "=" not in k and "," not in k and k.strip() not in GATE_KEYS),
              st.sampled_from(["0", "1", "0.5", "model"])).map("=".join),  # foo=0
    TEXT.filter(lambda s: "=" not in s and "," not in s),  # no '='
    st.tuples(st.sampled_from(sorted(GATE_KEYS)),
              TEXT.filter(lambda v: "," not in v and number(v) is None and v.strip() not in ("model", "learned"))
              ).map("=".join),  # pos=abc
)
BAD_GATES = st.one_of(
    GATE_ITEM_BAD,
    st.tuples(GATE_ITEM_BAD, st.sampled_from(["pos=0", "content=1", "pos=model"])).map(
        lambda t: ",".join(t)),  # one bad item beside a good one
    st.sampled_from(["pos=0,pos=1", "content=0.5,content=0.5"]),  # a key twice
    TEXT,
).filter(lambda s: not valid_gates(s))  # (an empty item, e.g. '', is no override: valid)


bad_family_path = st.one_of(
    st.tuples(OUT_OF_UNIT.filter(lambda s: re.fullmatch(r"[0-9.]+", s) is not None)
              | st.floats(1.001, 1e6).map(lambda x: f"{x:.4f}"), st.just("forced_const")).map(lambda t: t[1] + t[0]),
    st.one_of(st.floats(1.0, 1e6).map(lambda x: f"{x:.4f}"), st.sampled_from(["1", "1.0", "1.", "2"])
              ).map(lambda f: f"prior_dropout{f}"),  # a fraction of steps: [0, 1)
    st.sampled_from(["forced_const..5", "forced_const.", "prior_dropout0..1", "forced_const1.2.3"]),  # not numbers
    st.tuples(st.integers(0, 5000), TEXT.filter(lambda s: s not in FADE_SHAPES)).map(
        lambda t: f"fade{t[0]}->0:{t[1]}"),  # an unknown shape
    st.tuples(st.integers(0, 5000), st.sampled_from(["->1", "->0.5", "->", ":", "->0:"])).map(
        lambda t: f"fade{t[0]}{t[1]}"),  # fades go to 0
    st.integers(max_value=-1).map(lambda s: f"hard_switch{s}"),
)
BAD_PATH = st.one_of(bad_family_path, TEXT.filter(lambda s: not maybe_valid_path(s)))

TRAIN_OPTIONS = {
    "--task": not_in(TASKS), "--path": BAD_PATH, "--model": not_in(MODELS), "--baseline": not_in(BASELINES),
    "--seed": st.one_of(NOT_INT, NEGATIVE), "--steps": st.one_of(NOT_INT, NON_POSITIVE),
    "--checkpoint-every": st.one_of(NOT_INT, NEGATIVE),
    "--task-opt": st.one_of(TEXT.filter(lambda s: "=" not in s),
                            st.tuples(TEXT.filter(lambda k: "=" not in k and k.strip() not in ASSOC_RECALL_OPTIONS),
                                      TEXT).map("=".join)),
}


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (bytes) and directory (None) under ``root``, by relative path."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def names(value: str, line: str) -> bool:
    """The error line shows ``value`` as typed, as repr shows it, or with repr's escapes."""
    if value == "":
        return "''" in line
    return value in line or repr(value) in line or repr(value)[1:-1] in line


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's errors exit from inside parse_args
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def assert_rejected(argv: list[str], value: str, store: Path, must_not_exist: tuple[Path, ...] = (), also: str = ""):
    """``also``: another spelling of the value the error line may name instead."""
    before = snapshot(store)
    rc, out, err = run_cli(argv)
    assert "Traceback" not in out and "Traceback" not in err, err
    lines = err.splitlines()
    assert rc == 2, (argv, rc, err)
    assert len(lines) == 1, (argv, err)
    assert lines[0].startswith("softprior: error: "), lines[0]
    assert names(value, lines[0]) or (also and names(also, lines[0])), (value, lines[0])
    assert snapshot(store) == before, f"store changed by {argv}"
    for p in must_not_exist:
        assert not p.exists(), p


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[Path, str]:
    """A store holding one finished tiny run: (store dir, run id)."""
    root = tmp_path_factory.mktemp("fuzz") / "store"
    rc, out, err = run_cli(["train", "--path", "forced_zero", "--steps", "3", "--store", str(root), "--json",
                            "--no-progress"])
    assert rc == 0, err
    return root, json.loads(out.strip().splitlines()[-1])["run_id"]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """Outputs that must never be written, and a file and a directory that cannot be outputs."""
    d = tmp_path_factory.mktemp("scratch")
    (d / "a_file").write_text("not a directory")
    (d / "a_dir").mkdir()
    return d


# ------------------------------------------------------------------------------ command lines
@st.composite
def malformed_command(draw, run_id: str, scratch: Path, store: Path):
    """(argv, the value the error must name, files that must not appear)."""
    kind = draw(st.sampled_from(["train", "eval", "reproduce", "report", "export", "outputs", "store", "command"]))
    if kind == "train":
        opt = draw(st.sampled_from(sorted(TRAIN_OPTIONS)))
        v = draw(TRAIN_OPTIONS[opt])
        named = v.split("=", 1)[0].strip() if opt == "--task-opt" and "=" in v else v  # keys are stripped
        return ["train", "--steps", "1", "--json", "--no-progress", f"{opt}={v}", "--store", str(store)], named, ()
    if kind == "eval":
        which = draw(st.sampled_from(["--gates", "--length", "run_id"]))
        if which == "run_id":
            v = draw(TEXT.filter(lambda s: not run_id.startswith(s) and not s.startswith("-")))
            return ["eval", v, "--store", str(store)], v, ()
        v = draw(BAD_GATES if which == "--gates" else st.one_of(
            NOT_INT, st.integers(max_value=SHORTEST - 1).map(str), st.integers(LONGEST, 10 ** 12).map(str)))
        return ["eval", run_id, f"{which}={v}", "--store", str(store)], v, ()
    if kind in ("reproduce", "report"):
        which = draw(st.sampled_from(["name", "--seeds", "--tasks"] + (["--workers", "--group", "--executor"]
                                                                       if kind == "reproduce" else [])))
        out = scratch / "report-never-written"
        if which == "name":
            v = draw(not_in(EXPERIMENTS).filter(lambda s: not s.startswith("-")))
            argv = [kind, v]
        else:
            v = draw({"--seeds": st.one_of(NOT_INT, NON_POSITIVE),
                      "--tasks": TEXT.filter(lambda s: s == s.strip() and "," not in s and s not in TASK_FILTERS),
                      "--workers": st.one_of(NOT_INT, NON_POSITIVE),
                      "--group": st.one_of(NOT_INT.filter(lambda s: s.strip() != "auto"), NON_POSITIVE),
                      "--executor": not_in(EXECUTORS)}[which])
            argv = [kind, "removability", f"{which}={v}"]
        return argv + ["--quick", "--out", str(out), "--store", str(store)] + (
            ["--no-progress"] if kind == "reproduce" else []), v, (out,)
    if kind == "export":
        which = draw(st.sampled_from(["--format", "--n-ctx", "--gates", "--out"]))
        out = scratch / "export-never-written.safetensors"
        if which == "--out":  # a file name that does not say safetensors (and is not a directory)
            v = str(scratch / draw(TEXT.filter(lambda s: s.strip() and "/" not in s and "\0" not in s
                                               and not s.endswith(".safetensors") and s not in (".", "..", "a_dir"))))
            return ["export", run_id, "--out", v, "--store", str(store)], v, (Path(v),)
        v = draw({"--format": not_in(FORMATS), "--gates": BAD_GATES.filter(lambda s: s != ""),
                  "--n-ctx": st.one_of(NOT_INT, NON_POSITIVE)}[which])
        return ["export", run_id, "--out", str(out), f"{which}={v}", "--store", str(store)], v, (out,)
    if kind == "outputs":  # --out that is a file, --doc that is a directory or in no directory
        flag, v = draw(st.sampled_from([("--out", scratch / "a_file"), ("--out", scratch / "a_file" / "sub"),
                                        ("--doc", scratch / "a_dir"), ("--doc", scratch / "no_dir" / "doc.md"),
                                        ("--readme", scratch / "a_dir")]))
        cmd = draw(st.sampled_from(["report", "reproduce"]))
        argv = [cmd, draw(st.sampled_from(["removability", "paper"]) if flag != "--readme" else st.just("paper")),
                "--quick", flag, str(v), "--store", str(store)]
        if flag != "--out":
            argv += ["--out", str(scratch / "report-never-written")]
        return argv + (["--no-progress"] if cmd == "reproduce" else []), str(v), (scratch / "report-never-written",
                                                                                 scratch / "no_dir")
    if kind == "store":  # a read command on a store that is not there: an error, no new store
        typo = scratch / ("no_store_" + draw(st.text("abcdefghij", min_size=1, max_size=8)))
        cmd = draw(st.sampled_from([["eval", run_id], ["export", run_id, "--out", str(scratch / "x.safetensors")],
                                    ["report", "removability", "--quick", "--out", str(scratch / "never")],
                                    ["store", "verify"], ["store", "verify", "--repair"]]))
        return cmd + ["--store", str(typo)], str(typo), (typo, scratch / "x.safetensors", scratch / "never")
    v = draw(not_in(COMMANDS).filter(lambda s: not s.startswith("-")))
    return [v], v, ()


@SETTINGS
@given(data=st.data())
def test_malformed_command_lines(store, scratch, data):
    root, run_id = store
    argv, value, outputs = data.draw(malformed_command(run_id, scratch, root))
    assert_rejected(argv, value, root, outputs)


# ------------------------------------------------------------------------------ numbers out of their ranges
def outside(lo: float | None, hi: float | None, *, integer: bool, hi_open: bool = False):
    """Numbers outside [lo, hi] (or [lo, hi)): mostly next to a bound, where a loosened validator shows."""
    parts = []
    if integer:
        if lo is not None:
            parts += [st.integers(int(lo) - 3, int(lo) - 1), st.integers(max_value=int(lo) - 1)]
        if hi is not None:
            parts += [st.integers(int(hi) + 1, int(hi) + 3), st.integers(min_value=int(hi) + 1)]
        return st.one_of(parts).map(str)
    if lo is not None:
        parts += [st.floats(lo - 20, lo, exclude_max=True), st.floats(max_value=lo, exclude_max=True)]
    if hi is not None:
        parts += [st.floats(hi, hi + 20, exclude_min=not hi_open), st.floats(min_value=hi, exclude_min=not hi_open)]
    return st.one_of(parts).filter(math.isfinite).map(repr) | st.sampled_from(["nan", "inf", "-inf"])


UNIT = outside(0.0, 1.0, integer=False)  # a gate, a forced constant
RANGES = {  # option: (argv before the value, the values outside its range); the ranges are the README's
    "--gates pos": (["eval", "RUN", "--gates"], UNIT.map(lambda v: f"pos={v}")),
    "--gates content": (["eval", "RUN", "--gates"], UNIT.map(lambda v: f"pos=0,content={v}")),
    "export --gates": (["export", "RUN", "--out", "OUT", "--gates"], UNIT.map(lambda v: f"content={v}")),
    "--path forced_const": (["train", "--steps", "1", "--path"],
                            UNIT.filter(lambda v: re.fullmatch(r"[0-9.]+", v) is not None).map(
                                lambda v: f"forced_const{v}")),
    "--path prior_dropout": (["train", "--steps", "1", "--path"],  # a fraction of steps: [0, 1)
                             outside(0.0, 1.0, integer=False, hi_open=True).filter(
                                 lambda v: re.fullmatch(r"[0-9.]+", v) is not None).map(lambda v: f"prior_dropout{v}")),
    "--seed": (["train", "--steps", "1", "--seed"], outside(0, None, integer=True)),
    "--steps": (["train", "--steps"], outside(1, None, integer=True)),
    "--checkpoint-every": (["train", "--steps", "1", "--checkpoint-every"], outside(0, None, integer=True)),
    "--length": (["eval", "RUN", "--length"], outside(SHORTEST, LONGEST, integer=True)),
    "--n-ctx": (["export", "RUN", "--out", "OUT", "--n-ctx"], outside(1, None, integer=True)),
    "--seeds": (["report", "removability", "--quick", "--out", "OUT", "--seeds"], outside(1, None, integer=True)),
    "--workers": (["reproduce", "removability", "--quick", "--no-progress", "--out", "OUT", "--workers"],
                  outside(1, None, integer=True)),
    "--group": (["reproduce", "removability", "--quick", "--no-progress", "--out", "OUT", "--group"],
                outside(1, None, integer=True)),
    "--budget": (["calibrate", "assoc_recall", "--out", "OUT", "--budget"], outside(1, None, integer=True)),
}


@SETTINGS
@given(data=st.data())
def test_values_out_of_range(store, scratch, data):
    """Each numeric option next to and far beyond its bounds (written above, not read from the library)."""
    root, run_id = store
    option = data.draw(st.sampled_from(sorted(RANGES)))
    before, values = RANGES[option]
    v = data.draw(values)
    out = scratch / "never-written.safetensors"
    argv = [{"RUN": run_id, "OUT": str(out)}.get(a, a) for a in before] + [v, "--store", str(root)]
    if argv[0] == "train":
        argv += ["--json", "--no-progress"]
    # a path family's error may name the number alone (forced_const1.0000000000000002 passes paths.py's
    # 1e-12 tolerance, then the gate's own range refuses 1.0000000000000002)
    assert_rejected(argv, v, root, (out,), also=re.sub(r"^(forced_const|prior_dropout)", "", v))


# ------------------------------------------------------------------------------ path files
JSON = st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False, allow_subnormal=False) | st.integers() | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
# each breaks the file format of a path (the fields of PathConfig, written in SPEC above)
CORRUPTIONS = st.one_of(
    st.floats(allow_nan=False, allow_subnormal=False).filter(lambda f: not 0 <= f < 1).map(lambda f: {"prior_dropout": f}),
    TEXT.filter(lambda m: m not in GATE_MODES).map(lambda m: {"pos": {"mode": m}}),
    st.just({"content": {"mode": "fixed"}}),  # fixed without a value
    st.floats(allow_nan=False, allow_subnormal=False).filter(lambda f: not 0 <= f <= 1).map(
        lambda f: {"pos": {"mode": "fixed", "value": f}}),
    st.integers(max_value=0).map(lambda n: {"steps": n}),
    st.integers(max_value=0).map(lambda n: {"parent_steps": n, "parent": {"name": "unforced"}}),
    st.tuples(TEXT.filter(lambda k: k not in PATH_FIELDS), JSON).map(lambda kv: {kv[0]: kv[1]}),  # an unknown field
    TEXT.filter(lambda k: k not in SCHEDULE_KINDS).map(lambda k: {"pos": {"mode": "scheduled", "schedule": {"kind": k}}}),
)


def _object(data) -> bool:
    return isinstance(data, dict)


PATH_FILES = st.one_of(
    st.binary(max_size=64).filter(lambda b: b.decode("utf-8", "replace") != b.decode("utf-8", "ignore")).map(
        lambda b: (b, ".json")),  # not UTF-8
    JSON.filter(lambda d: not _object(d)).map(lambda d: (json.dumps(d).encode(), ".json")),  # a path is an object
    JSON.filter(lambda d: _object(d) and bool(set(d) - PATH_FIELDS)).map(
        lambda d: (json.dumps(d).encode(), ".json")),  # with a field a path does not have
    st.tuples(TEXT, CORRUPTIONS).map(lambda t: (json.dumps({"name": t[0] or "p", **t[1]}).encode(), ".json")),
    st.sampled_from([b"", b"{", b"[1, 2", b"name = ", b"= 1", b"[table\nx = 1"]).map(lambda b: (b, ".toml")),
    st.sampled_from([b"", b"{", b"not json", b"{'name': 'single quotes'}", b"{\"name\": }"]).map(lambda b: (b, ".json")),
)


@SETTINGS
@given(content_suffix=PATH_FILES)
def test_malformed_path_files(store, content_suffix, tmp_path_factory):
    root, _ = store
    content, suffix = content_suffix
    f = tmp_path_factory.mktemp("pathfile") / f"my_path{suffix}"
    f.write_bytes(content)
    assert_rejected(["train", "--path", str(f), "--steps", "1", "--store", str(root), "--json", "--no-progress"],
                    str(f), root)


# ------------------------------------------------------------------------------ plugin files
_EXCEPTIONS = ["ValueError", "RuntimeError", "KeyError", "TypeError", "ZeroDivisionError", "AttributeError",
               "ImportError", "OSError", "NameError", "Exception", "AssertionError", "IndexError"]
PLUGINS = st.one_of(
    TEXT.map(lambda t: (t + "\n)(\n").encode()),  # never valid Python: an unmatched ')' at the end
    st.tuples(st.sampled_from(_EXCEPTIONS), TEXT).map(lambda e: f"raise {e[0]}({e[1]!r})\n".encode()),
    TEXT.map(lambda t: f"import zz_no_such_module_{abs(hash(t))}\n".encode()),
    st.binary(min_size=1, max_size=32).map(lambda b: b"\xff\xfe" + b),  # not UTF-8
    st.just(b"from softprior.experiments import get_experiment, register_experiment\n"
            b"register_experiment(get_experiment('removability'))\n"),  # already registered
    st.just(b"from softprior.paths import register_path, get_path\nregister_path(get_path('unforced'))\n"),
)


@SETTINGS
@given(content=PLUGINS, command=st.sampled_from(["experiments", "reproduce", "report"]))
def test_malformed_plugin_files(store, content, command, tmp_path_factory):
    root, _ = store
    d = tmp_path_factory.mktemp("plugin")
    f = d / "my_plugin.py"
    f.write_bytes(content)
    argv = ["experiments", "--plugin", str(f)] if command == "experiments" else \
        [command, "removability", "--quick", "--plugin", str(f), "--store", str(root), "--out", str(d / "out")]
    if command == "reproduce":
        argv.append("--no-progress")
    assert_rejected(argv, str(f), root, (d / "out",))


def test_missing_plugin_and_path_files_are_named(store, tmp_path):
    root, _ = store
    for argv, f in ((["experiments", "--plugin", str(tmp_path / "nope.py")], tmp_path / "nope.py"),
                    (["train", "--path", str(tmp_path / "nope.json"), "--store", str(root)], tmp_path / "nope.json")):
        assert_rejected(argv, str(f), root)

