"""Property-based tests (Hypothesis): malformed command lines, path files and plugin files.

Every malformed input must get exactly one line on stderr, ``softprior: error: ...``, that names the
bad value (or the bad file), exit code 2, no traceback, and leave the run store byte-for-byte as it
was. Inputs are drawn so that they are invalid (a valid one would train): strategies filter out
values that the library accepts. Few examples per property (``max_examples=25``) keep this fast.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from softprior.cli import CliError, main, parse_gates
from softprior.config import make_run_config
from softprior.tasks import make_task

SETTINGS = settings(max_examples=25, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# printable-or-not text without lone surrogates (argv decoded by Python never has them unpaired
# except through surrogateescape, which stderr's backslashreplace handles; StringIO does not)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=16)


# ------------------------------------------------------------------------------ harness
def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's errors exit from inside parse_args
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (bytes) and directory (None) under ``root``, by relative path."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def names(value: str, line: str) -> bool:
    """The error line shows ``value`` as typed, as repr shows it, or with repr's escapes."""
    if value == "":
        return "''" in line
    return value in line or repr(value) in line or repr(value)[1:-1] in line


def assert_rejected(argv: list[str], value: str, store: Path, must_not_exist: tuple[Path, ...] = ()):
    before = snapshot(store)
    rc, out, err = run_cli(argv)
    assert "Traceback" not in out and "Traceback" not in err, err
    lines = err.splitlines()
    assert rc == 2, (argv, rc, err)
    assert len(lines) == 1, (argv, err)
    assert lines[0].startswith("softprior: error: "), lines[0]
    assert names(value, lines[0]), (value, lines[0])
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


# ------------------------------------------------------------------------------ invalid values
def _rejects(resolve):
    """A filter: True when ``resolve(value)`` raises ValueError (the library refuses the value)."""
    def bad(v):
        try:
            resolve(v)
        except ValueError:
            return True
        return False
    return bad


def _not_int(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return True
    return False


NOT_INT = TEXT.filter(_not_int)
NEGATIVE = st.integers(max_value=-1).map(str)
BAD_TASK = TEXT.filter(_rejects(lambda v: make_run_config(v, "unforced")))
BAD_PATH = TEXT.filter(_rejects(lambda v: make_run_config("assoc_recall", v)))
BAD_MODEL = TEXT.filter(_rejects(lambda v: make_run_config("assoc_recall", "unforced", model=v)))
BAD_BASELINE = TEXT.filter(_rejects(lambda v: make_run_config("assoc_recall", baseline=v)))
BAD_TASK_OPT = st.one_of(TEXT.filter(lambda s: "=" not in s),
                         st.tuples(TEXT.map(lambda k: "zz" + k), TEXT).map(lambda kv: "=".join(kv)))


def _bad_gates(s: str) -> bool:
    try:
        parse_gates(s)
    except CliError:
        return True
    return False


BAD_GATES = TEXT.filter(lambda s: s != "" and _bad_gates(s))
BAD_TASK_FILTER = TEXT.filter(lambda s: s == s.strip() and "," not in s).filter(
    lambda s: s not in ("assoc_recall", "markov", "linear_icl", "markov p=0.2", "markov p=0.5", "markov p=0.8"))
BAD_EXPERIMENT = TEXT.filter(lambda s: s not in dict(__import__("softprior.experiments").experiments.list_experiments()))

TRAIN_OPTIONS = {
    "--task": BAD_TASK, "--path": BAD_PATH, "--model": BAD_MODEL, "--baseline": BAD_BASELINE,
    "--seed": st.one_of(NOT_INT, NEGATIVE), "--steps": st.one_of(NOT_INT, NEGATIVE, st.just("0")),
    "--checkpoint-every": st.one_of(NOT_INT, NEGATIVE), "--task-opt": BAD_TASK_OPT,
}


@st.composite
def malformed_command(draw, run_id: str, scratch: Path):
    """(argv without --store, the value the error must name, files that must not appear)."""
    kind = draw(st.sampled_from(["train", "eval", "reproduce", "report", "export", "command"]))
    if kind == "train":
        opt = draw(st.sampled_from(sorted(TRAIN_OPTIONS)))
        v = draw(TRAIN_OPTIONS[opt])
        named = v.split("=", 1)[0].strip() if opt == "--task-opt" and "=" in v else v  # keys are stripped
        return ["train", "--steps", "1", "--json", "--no-progress", f"{opt}={v}"], named, ()
    if kind == "eval":
        which = draw(st.sampled_from(["--gates", "--length", "run_id"]))
        if which == "run_id":
            v = draw(TEXT.filter(lambda s: not run_id.startswith(s) and not s.startswith("-")))
            return ["eval", v], v, ()
        too_short = make_task(make_run_config("assoc_recall", "forced_zero").task).min_length() - 1  # the stored run's task
        v = draw(BAD_GATES if which == "--gates" else st.one_of(NOT_INT, NEGATIVE, st.integers(0, too_short).map(str)))
        return ["eval", run_id, f"{which}={v}"], v, ()
    if kind in ("reproduce", "report"):
        which = draw(st.sampled_from(["name", "--seeds", "--tasks"] + (["--workers", "--group", "--executor"]
                                                                       if kind == "reproduce" else [])))
        out = scratch / "report-never-written"
        if which == "name":
            v = draw(BAD_EXPERIMENT.filter(lambda s: not s.startswith("-")))
            argv = [kind, v]
        else:
            v = draw({"--seeds": st.one_of(NOT_INT, NEGATIVE, st.just("0")), "--tasks": BAD_TASK_FILTER,
                      "--workers": st.one_of(NOT_INT, NEGATIVE, st.just("0")),
                      "--group": st.one_of(NOT_INT.filter(lambda s: s.strip() != "auto"), NEGATIVE, st.just("0")),
                      "--executor": TEXT.filter(lambda s: s not in ("local", "ray"))}[which])
            argv = [kind, "removability", f"{which}={v}"]
        return argv + ["--quick", "--out", str(out)] + (["--no-progress"] if kind == "reproduce" else []), v, (out,)
    if kind == "export":
        which = draw(st.sampled_from(["--format", "--n-ctx", "--gates"]))
        v = draw({"--format": TEXT.filter(lambda s: s != "transformer-lens"), "--gates": BAD_GATES,
                  "--n-ctx": st.one_of(NOT_INT, NEGATIVE, st.just("0"))}[which])
        out = scratch / "export-never-written.safetensors"
        return ["export", run_id, "--out", str(out), f"{which}={v}"], v, (out,)
    v = draw(TEXT.filter(lambda s: s not in ("train", "eval", "reproduce", "report", "experiments", "baselines",
                                             "bench", "export", "paths", "tasks") and not s.startswith("-")))
    return [v], v, ()


@SETTINGS
@given(data=st.data())
def test_malformed_command_lines(store, data, tmp_path_factory):
    root, run_id = store
    argv, value, outputs = data.draw(malformed_command(run_id, root.parent / "scratch"))
    if argv[0] in ("train", "eval", "reproduce", "report", "export"):
        argv = argv + ["--store", str(root)]
    assert_rejected(argv, value, root, outputs)


# ------------------------------------------------------------------------------ path files
JSON = st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False, allow_subnormal=False) | st.integers() | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
CORRUPTIONS = st.one_of(
    st.floats(allow_nan=False, allow_subnormal=False).filter(lambda f: not 0 <= f < 1).map(lambda f: {"prior_dropout": f}),
    TEXT.filter(lambda m: m not in ("learned", "fixed", "scheduled")).map(lambda m: {"pos": {"mode": m}}),
    st.just({"content": {"mode": "fixed"}}),  # fixed without a value
    st.floats(allow_nan=False, allow_subnormal=False).filter(lambda f: not 0 <= f <= 1).map(lambda f: {"pos": {"mode": "fixed", "value": f}}),
    st.integers(max_value=0).map(lambda n: {"steps": n}),
    st.tuples(TEXT, JSON).map(lambda kv: {"zz_" + kv[0]: kv[1]}),  # an unknown field
    st.just({"pos": {"mode": "scheduled", "schedule": {"kind": "nonexistent"}}}),
)


def _invalid_path_config(text: str, suffix: str) -> bool:
    from softprior.paths import PathConfig, tomllib
    try:
        data = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
        PathConfig.model_validate(data)
    except Exception:  # noqa: BLE001 - any refusal: that is the domain we want
        return True
    return False


PATH_FILES = st.one_of(
    st.tuples(st.binary(max_size=64), st.sampled_from([".json", ".toml"])),  # anything, even not UTF-8
    st.tuples(JSON.map(json.dumps).map(str.encode), st.just(".json")),
    st.tuples(st.tuples(TEXT, CORRUPTIONS).map(lambda t: json.dumps({"name": t[0] or "p", **t[1]}).encode()),
              st.just(".json")),
    st.tuples(TEXT.map(str.encode), st.just(".toml")),
).filter(lambda cs: cs[0].decode("utf-8", "replace") != cs[0].decode("utf-8", "ignore")
         or _invalid_path_config(cs[0].decode("utf-8", "ignore"), cs[1]))


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
