"""Training paths as data (SPEC section 3): named paths, parametrised families, user files."""

from __future__ import annotations

import json
import sys

import pytest
from pydantic import ValidationError

import softprior.paths as paths_mod
from softprior.paths import (
    GateConfig, PathConfig, UnknownPathError, get_path, list_paths, load_path_file, register_path,
)
from softprior.schedules import Fade, HardSwitch, Linear

TOTAL = 3600


def _both(p: PathConfig, step: int, total: int = TOTAL):
    return p.pos.value_at(step, total), p.content.value_at(step, total)


@pytest.fixture
def clean_registry(monkeypatch):
    """Registrations made by a test are undone afterwards."""
    from softprior.registry import Registry
    old = paths_mod._FIXED_PATHS
    monkeypatch.setattr(paths_mod, "_FIXED_PATHS", Registry(old.kind, old.error, old, old.describe))


# ------------------------------------------------------------------ named paths
def test_unforced_both_gates_learned():
    p = get_path("unforced")
    assert p.pos.mode == p.content.mode == "learned"
    assert _both(p, 0) == (None, None)
    assert p.prior_dropout == 0.0 and not p.dual_loss and p.parent is None


def test_forced_zero():
    p = get_path("forced_zero")
    assert p.pos.mode == p.content.mode == "fixed"
    for s in (0, 600, 3599):
        assert _both(p, s) == (0.0, 0.0)


@pytest.mark.parametrize("name,c", [("forced_const0.5", 0.5), ("forced_const0.25", 0.25), ("forced_const1", 1.0),
                                    ("forced_const0", 0.0)])
def test_forced_const(name, c):
    p = get_path(name)
    assert p.pos.mode == p.content.mode == "fixed"
    for s in (0, 1234, 3599):
        assert _both(p, s) == (c, c)


def test_linear_path_reaches_zero_at_final_step():
    p = get_path("linear0.5->0")
    assert _both(p, 0) == (0.5, 0.5)
    assert _both(p, 1000, 2001) == pytest.approx((0.25, 0.25))
    assert _both(p, TOTAL - 1) == (0.0, 0.0)
    assert isinstance(p.pos.schedule, Linear)


def test_prior_dropout_and_dual_loss_named_paths():
    pd_ = get_path("prior_dropout")
    assert pd_.prior_dropout == 0.5 and pd_.pos.mode == "learned" and not pd_.dual_loss
    dl = get_path("dual_loss")
    assert dl.dual_loss and dl.prior_dropout == 0.0 and dl.pos.mode == "learned"


def test_posthoc_continues_unforced_at_zero_for_2550_steps():
    p = get_path("posthoc")
    assert p.parent is not None and p.parent.name == "unforced"
    assert p.parent.pos.mode == "learned"
    assert p.steps == 2550
    assert _both(p, 0) == (0.0, 0.0)


@pytest.mark.parametrize("name", ["fade600", "fade600->0", "fade600->0:linear", "fade600:linear"])
def test_fade_family_linear(name):
    p = get_path(name)
    assert p.name == "fade600->0"  # one canonical name, so all spellings hash to the same run
    assert p.pos.mode == p.content.mode == "scheduled"
    assert p.pos.schedule == Fade(start_step=600, width=450, shape="linear")
    # hand values: 0.5 until 600, 0.25 at 825, 0 from 1050
    assert _both(p, 0) == (0.5, 0.5)
    assert _both(p, 600) == (0.5, 0.5)
    assert _both(p, 825) == pytest.approx((0.25, 0.25))
    assert _both(p, 1050) == (0.0, 0.0)
    assert _both(p, 3599) == (0.0, 0.0)


@pytest.mark.parametrize("shape,mid", [("cosine", 0.25), ("convex", 0.125), ("concave", 0.375), ("two_step", 0.25)])
def test_fade_family_shapes(shape, mid):
    p = get_path(f"fade600->0:{shape}")
    assert p.name == f"fade600->0:{shape}"
    assert p.pos.schedule.shape == p.content.schedule.shape == shape
    assert _both(p, 825) == pytest.approx((mid, mid))
    assert _both(p, 1050) == (0.0, 0.0)


def test_fade_family_other_start():
    p = get_path("fade400->0:cosine")
    assert p.pos.schedule == Fade(start_step=400, width=450, shape="cosine")
    assert _both(p, 625) == pytest.approx((0.25, 0.25))
    assert _both(p, 850) == (0.0, 0.0)


@pytest.mark.parametrize("name", ["hard_switch1050", "switch1050"])
def test_hard_switch_family(name):
    p = get_path(name)
    assert p.name == "hard_switch1050"
    assert p.pos.schedule == HardSwitch(at=1050)
    assert _both(p, 1049) == (0.5, 0.5)
    assert _both(p, 1050) == (0.0, 0.0)


def test_hard_switch600():
    p = get_path("hard_switch600")
    assert _both(p, 599) == (0.5, 0.5) and _both(p, 600) == (0.0, 0.0)


def test_prior_dropout_family():
    p = get_path("prior_dropout0.3")
    assert p.prior_dropout == pytest.approx(0.3)
    assert p.pos.mode == p.content.mode == "learned"
    assert p.name == "prior_dropout0.3"


def test_list_paths_names_every_named_path_and_family():
    names = [n for n, _ in list_paths()]
    for n in ("unforced", "forced_zero", "forced_const0.5", "linear0.5->0", "prior_dropout", "dual_loss", "posthoc"):
        assert n in names
    joined = " ".join(names)
    for fam in ("fade", "hard_switch", "forced_const", "prior_dropout"):
        assert fam in joined
    assert all(desc for _, desc in list_paths())


# ------------------------------------------------------------------ errors
def test_unknown_name_lists_allowed_values():
    with pytest.raises(UnknownPathError) as ei:
        get_path("no_such_path")
    msg = str(ei.value)
    assert "no_such_path" in msg
    for allowed in ("unforced", "forced_zero", "fadeS->0", "hard_switch"):
        assert allowed in msg


@pytest.mark.parametrize("shape", ["sine", "linearx", "TWO_STEP"])
def test_bad_fade_shape_names_allowed_shapes(shape):
    with pytest.raises(UnknownPathError) as ei:
        get_path(f"fade600->0:{shape}")
    msg = str(ei.value)
    assert shape in msg
    for s in ("linear", "cosine", "convex", "concave", "two_step"):
        assert s in msg


@pytest.mark.parametrize("name", ["forced_const1.5", "forced_const0.5.5", "fade600->1", "hard_switch", "fade"])
def test_malformed_family_members_raise_unknown_path(name):
    with pytest.raises(UnknownPathError) as ei:
        get_path(name)
    assert repr(name) in str(ei.value)


# Regression: get_path('prior_dropout1') lets a pydantic
# ValidationError escape instead of UnknownPathError (_float_in_unit accepts 1.0 but
# PathConfig.prior_dropout needs < 1)
def test_prior_dropout_of_one_is_unknown_path_error():
    with pytest.raises(UnknownPathError):
        get_path("prior_dropout1")


def test_unknown_path_error_is_value_error():
    assert issubclass(UnknownPathError, ValueError)


# ------------------------------------------------------------------ user paths from files
USER_PATH = {
    "name": "my_cosine_fade",
    "description": "a user-defined path",
    "pos": {"mode": "scheduled", "schedule": {"kind": "fade", "start_step": 100, "width": 40, "shape": "cosine"}},
    "content": {"mode": "fixed", "value": 0.0},
    "prior_dropout": 0.1,
}

USER_TOML = """
name = "my_cosine_fade"
description = "a user-defined path"
prior_dropout = 0.1

[pos]
mode = "scheduled"

[pos.schedule]
kind = "fade"
start_step = 100
width = 40
shape = "cosine"

[content]
mode = "fixed"
value = 0.0
"""


def _check_user_path(p: PathConfig):
    assert p.name == "my_cosine_fade"
    assert p.pos.schedule == Fade(start_step=100, width=40, shape="cosine")
    assert p.content == GateConfig(mode="fixed", value=0.0)
    assert p.prior_dropout == pytest.approx(0.1)
    # cosine fade midpoint 120 -> 0.25, end 140 -> 0
    assert p.pos.value_at(120, 1000) == pytest.approx(0.25)
    assert p.pos.value_at(140, 1000) == 0.0
    assert p.content.value_at(0, 1000) == 0.0


def test_user_path_from_json(tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps(USER_PATH))
    _check_user_path(get_path(str(f)))
    _check_user_path(load_path_file(f))


def test_user_path_from_toml(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text(USER_TOML)
    _check_user_path(get_path(str(f)))


def test_json_and_toml_give_the_same_path(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(USER_PATH))
    (tmp_path / "b.toml").write_text(USER_TOML)
    assert get_path(str(tmp_path / "a.json")) == get_path(str(tmp_path / "b.toml"))


def test_missing_path_file(tmp_path):
    with pytest.raises(UnknownPathError) as ei:
        get_path(str(tmp_path / "nope.json"))
    assert "nope.json" in str(ei.value)


def test_invalid_path_file_names_the_field(tmp_path):
    bad = dict(USER_PATH, pos={"mode": "fixed"})  # fixed without a value
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(bad))
    with pytest.raises(UnknownPathError) as ei:
        get_path(str(f))
    assert "value" in str(ei.value) and "bad.json" in str(ei.value)

    bad2 = dict(USER_PATH, prior_dropuot=0.3)  # misspelt field
    f2 = tmp_path / "bad2.json"
    f2.write_text(json.dumps(bad2))
    with pytest.raises(UnknownPathError) as ei:
        get_path(str(f2))
    assert "prior_dropuot" in str(ei.value)


def test_unparseable_path_file(tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text("name = [unterminated")
    with pytest.raises(UnknownPathError):
        get_path(str(f))


# ------------------------------------------------------------------ register_path
def test_register_path(clean_registry):
    p = PathConfig(name="test_only_half_pos", pos=GateConfig(mode="fixed", value=0.5))
    assert register_path(p) is p
    assert get_path("test_only_half_pos") is p
    assert "test_only_half_pos" in [n for n, _ in list_paths()]
    with pytest.raises(ValueError, match="already registered"):
        register_path(PathConfig(name="test_only_half_pos"))
    q = PathConfig(name="test_only_half_pos", description="replaced")
    register_path(q, overwrite=True)
    assert get_path("test_only_half_pos").description == "replaced"


def test_registry_fixture_isolates(clean_registry):
    with pytest.raises(UnknownPathError):
        get_path("test_only_half_pos")


# ------------------------------------------------------------------ GateConfig validation
@pytest.mark.parametrize("kwargs,field", [
    (dict(mode="fixed"), "value"),
    (dict(mode="scheduled"), "schedule"),
    (dict(mode="learned", value=0.3), "value"),
    (dict(mode="learned", schedule=Fade()), "schedule"),
    (dict(mode="fixed", value=1.5), "value"),
    (dict(mode="fixed", value=-0.5), "value"),
    (dict(mode="bogus"), "mode"),
    (dict(mode="fixed", value=0.5, colour="red"), "colour"),
])
def test_gate_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValidationError) as ei:
        GateConfig(**kwargs)
    assert field in str(ei.value)


def test_gate_config_value_at():
    assert GateConfig().value_at(5, 10) is None
    assert GateConfig(mode="fixed", value=0.7).value_at(5, 10) == 0.7
    g = GateConfig(mode="scheduled", schedule={"kind": "hard_switch", "at": 5})
    assert g.value_at(4, 10) == 0.5 and g.value_at(5, 10) == 0.0


@pytest.mark.parametrize("kwargs,field", [
    (dict(name="x", prior_dropout=1.0), "prior_dropout"),
    (dict(name="x", prior_dropout=-0.1), "prior_dropout"),
    (dict(name="x", steps=0), "steps"),
    (dict(name="x", pos={"mode": "scheduled", "schedule": {"kind": "fade", "shape": "sine"}}), "shape"),
])
def test_path_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValidationError) as ei:
        PathConfig(**kwargs)
    assert field in str(ei.value)


# ------------------------------------------------------------------ Python 3.10: tomli instead of tomllib
_PY310 = r"""
import sys, types
import tomllib as real
calls = []
stub = types.ModuleType("tomli")
stub.loads = lambda s: calls.append(s) or real.loads(s)
sys.modules["tomli"] = stub
sys.modules["tomllib"] = None  # `import tomllib` now raises ModuleNotFoundError, as on Python 3.10
from softprior.paths import load_path_file
p = load_path_file(sys.argv[1])
print(p.name, p.pos.mode, len(calls))
"""


@pytest.mark.skipif(sys.version_info < (3, 11), reason="simulates 3.10 on 3.11+ (on 3.10 the other tests use tomli)")
def test_toml_path_files_load_without_tomllib(tmp_path):
    """requires-python says 3.10, which has no tomllib: paths.py falls back to tomli (declared for
    python_version < '3.11' in pyproject.toml). Simulated here by hiding tomllib from the import."""
    import subprocess
    import sys
    f = tmp_path / "p.toml"
    f.write_text('name = "my_toml_path"\n[pos]\nmode = "fixed"\nvalue = 0.25\n')
    out = subprocess.run([sys.executable, "-c", _PY310, str(f)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["my_toml_path", "fixed", "1"]  # parsed once, by tomli


def test_pyproject_declares_tomli_for_python_310():
    from pathlib import Path
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert meta["requires-python"] == ">=3.10"
    assert "tomli>=1.1; python_version < '3.11'" in meta["dependencies"]


# ------------------------------------------------------------------ budgets (issue 30, item 4)
def test_fits_budget_names_the_paths_a_short_run_would_mislabel():
    from softprior.paths import fits_budget, settles_at
    assert settles_at(get_path("fade600")) == 1050 and settles_at(get_path("unforced")) is None
    assert not fits_budget(get_path("fade600"), 200) and not fits_budget(get_path("fade600"), 1050)
    assert fits_budget(get_path("fade600"), 1051) and fits_budget(get_path("fade600"), 3600)
    assert not fits_budget(get_path("hard_switch1050"), 1000) and fits_budget(get_path("hard_switch1050"), 3600)
    for name in ("unforced", "forced_zero", "linear0.5->0", "posthoc", "prior_dropout", "forced_const0.5"):
        assert fits_budget(get_path(name), 5), name
    # a derived path is checked on its parent's budget too
    child = PathConfig(name="after_fade", parent=get_path("fade600"), parent_steps=800)
    assert not fits_budget(child, 3600) and fits_budget(child.model_copy(update={"parent_steps": 2000}), 3600)


def test_scale_to_budget_scales_as_quick_does_and_renames():
    from softprior.paths import fits_budget, scale_path, scale_to_budget
    p = get_path("fade600")
    s = scale_to_budget(p, 200)
    assert s.name == "fade600->0 scaled 200/3600" and fits_budget(s, 200)
    assert s.pos == scale_path(p, 200 / 3600).pos and (s.pos.schedule.start_step, s.pos.schedule.width) == (33, 25)
    assert s.description == "fade600->0 scaled x0.05556: g = 0.5 until step 33, linear fade to 0 by step 58"
    assert scale_to_budget(p, 3600) is p
    # --quick's scaling keeps the name (and so its run ids); only the unhashed description says it is scaled
    q = scale_path(p, 180 / 3600)
    assert q.name == p.name and q.description.startswith("fade600->0 scaled x0.05:")
    assert scale_path(p, 1.0) == p
