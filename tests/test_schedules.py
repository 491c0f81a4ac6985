"""Gate schedules against values worked out by hand (SPEC section 3)."""

from __future__ import annotations

import math

import pytest
from pydantic import TypeAdapter, ValidationError

from softprior.schedules import FADE_SHAPES, Constant, Fade, HardSwitch, Linear, Schedule, gate_value

TOTAL = 3600

# Fade(start_step=600, width=450) from 0.5 to 0: u = clip((step - 600) / 450, 0, 1).
# step 825 is u = 1/2:  linear f=1/2 -> 0.25; cosine (1 - cos(pi/2))/2 = 1/2 -> 0.25;
# convex 1 - (1/2)^2 = 3/4 -> 0.125; concave (1/2)^2 = 1/4 -> 0.375; two_step f = 1/2 -> 0.25.
MAIN_FADE = {
    #           step 0  600   825    1050  2000
    "linear":   (0.5, 0.5, 0.25, 0.0, 0.0),
    "cosine":   (0.5, 0.5, 0.25, 0.0, 0.0),
    "convex":   (0.5, 0.5, 0.125, 0.0, 0.0),
    "concave":  (0.5, 0.5, 0.375, 0.0, 0.0),
    "two_step": (0.5, 0.5, 0.25, 0.0, 0.0),
}

# Fade(start_step=100, width=400): step 200 is u = 1/4, step 400 is u = 3/4.
# cos(pi/4) = cos(3pi/4) magnitude = sqrt(2)/2.
_R2 = math.sqrt(2.0) / 2.0
QUARTERS = {
    "linear":   (0.5 - 0.5 * 0.25, 0.5 - 0.5 * 0.75),                       # 0.375, 0.125
    "cosine":   (0.5 - 0.5 * (1 - _R2) / 2, 0.5 - 0.5 * (1 + _R2) / 2),     # 0.42678, 0.07322
    "convex":   (0.5 - 0.5 * (1 - 0.75 ** 2), 0.5 - 0.5 * (1 - 0.25 ** 2)),  # 0.28125, 0.03125
    "concave":  (0.5 - 0.5 * 0.25 ** 2, 0.5 - 0.5 * 0.75 ** 2),             # 0.46875, 0.21875
    "two_step": (0.5, 0.25),
}


def test_fade_shapes_constant_lists_all_five():
    assert set(FADE_SHAPES) == {"linear", "cosine", "convex", "concave", "two_step"}


@pytest.mark.parametrize("shape", sorted(MAIN_FADE))
def test_main_fade_by_hand(shape):
    f = Fade(start_step=600, width=450, shape=shape)
    for step, want in zip((0, 600, 825, 1050, 2000), MAIN_FADE[shape]):
        assert f(step, TOTAL) == pytest.approx(want, abs=1e-12), (shape, step)
    assert f.end_step == 1050


@pytest.mark.parametrize("shape", sorted(QUARTERS))
def test_fade_quarter_points_by_hand(shape):
    f = Fade(start_step=100, width=400, shape=shape)
    q1, q3 = QUARTERS[shape]
    assert f(200, TOTAL) == pytest.approx(q1, abs=1e-12)
    assert f(400, TOTAL) == pytest.approx(q3, abs=1e-12)


@pytest.mark.parametrize("shape", FADE_SHAPES)
def test_fade_is_monotone_and_bounded(shape):
    f = Fade(start_step=600, width=450, shape=shape)
    vals = [f(s, TOTAL) for s in range(0, 1300)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert max(vals) == 0.5 and min(vals) == 0.0


def test_fade_defaults_are_the_papers_main_fade():
    f = Fade()
    assert (f.start_value, f.end_value, f.start_step, f.width, f.shape) == (0.5, 0.0, 600, 450, "linear")


def test_cosine_fade_is_point_symmetric_about_midpoint():
    f = Fade(start_step=0, width=100, shape="cosine")
    for s in range(0, 101):
        assert f(s, TOTAL) + f(100 - s, TOTAL) == pytest.approx(0.5, abs=1e-12)


def test_convex_and_concave_are_mirror_images():
    # convex g(u) = 0.5 (1-u)^2, concave g(u) = 0.5 (1-u^2): g_convex(u) = 0.5 - g_concave(1-u)
    cv, cc = Fade(start_step=0, width=100, shape="convex"), Fade(start_step=0, width=100, shape="concave")
    for s in range(0, 101):
        assert cv(s, TOTAL) == pytest.approx(0.5 - cc(100 - s, TOTAL), abs=1e-12)
    # the convex curve drops faster at the start than linear, the concave one slower
    lin = Fade(start_step=0, width=100)
    assert cv(10, TOTAL) < lin(10, TOTAL) < cc(10, TOTAL)


def test_two_step_drops_exactly_at_midpoint_even_width():
    f = Fade(start_step=600, width=450, shape="two_step")
    assert f(824, TOTAL) == 0.5
    assert f(825, TOTAL) == 0.25  # 600 + 450/2
    assert f(1049, TOTAL) == 0.25
    assert f(1050, TOTAL) == 0.0
    # exactly three distinct values, two equal drops
    assert sorted({f(s, TOTAL) for s in range(0, 2000)}) == [0.0, 0.25, 0.5]


def test_two_step_drops_at_midpoint_odd_width():
    f = Fade(start_step=600, width=451, shape="two_step")  # midpoint 825.5
    assert f(825, TOTAL) == 0.5
    assert f(826, TOTAL) == 0.25
    assert f(1050, TOTAL) == 0.25
    assert f(1051, TOTAL) == 0.0


def test_fade_with_other_start_and_end_values():
    f = Fade(start_value=0.8, end_value=0.2, start_step=10, width=20, shape="linear")
    assert f(0, 100) == pytest.approx(0.8)
    assert f(20, 100) == pytest.approx(0.5)
    assert f(30, 100) == pytest.approx(0.2)
    assert f(99, 100) == pytest.approx(0.2)


def test_linear_default_ends_at_final_step():
    # 0.5 at step 0 -> 0 at the final step (index total-1); total 101 -> end at 100
    lin = Linear()
    assert lin(0, 101) == 0.5
    assert lin(25, 101) == pytest.approx(0.375)
    assert lin(50, 101) == pytest.approx(0.25)
    assert lin(99, 101) == pytest.approx(0.005)
    assert lin(100, 101) == 0.0
    # with the default budget: the last training step (3599) is at 0, the one before is not
    assert lin(TOTAL - 1, TOTAL) == 0.0
    assert lin(TOTAL - 2, TOTAL) == pytest.approx(0.5 / 3599)


def test_linear_explicit_window():
    lin = Linear(start_value=0.0, end_value=1.0, start_step=10, end_step=30)
    assert lin(0, 1000) == 0.0
    assert lin(10, 1000) == 0.0
    assert lin(15, 1000) == pytest.approx(0.25)
    assert lin(20, 1000) == pytest.approx(0.5)
    assert lin(30, 1000) == 1.0
    assert lin(500, 1000) == 1.0


def test_hard_switch_before_and_after():
    hs = HardSwitch(at=1050)
    assert hs(0, TOTAL) == 0.5
    assert hs(1049, TOTAL) == 0.5
    assert hs(1050, TOTAL) == 0.0
    assert hs(3599, TOTAL) == 0.0
    hs0 = HardSwitch(at=0, before=0.9, after=0.1)
    assert hs0(0, TOTAL) == 0.1


def test_constant():
    c = Constant(value=0.3)
    assert [c(s, TOTAL) for s in (0, 1, 3599)] == [0.3, 0.3, 0.3]


def test_gate_value_returns_python_float():
    v = gate_value(Fade(shape="cosine"), 825, TOTAL)
    assert type(v) is float and v == pytest.approx(0.25)


@pytest.mark.parametrize("bad", [
    lambda: Constant(value=1.5),
    lambda: Constant(value=-0.1),
    lambda: Fade(width=0),
    lambda: Fade(shape="sine"),
    lambda: Fade(start_value=2.0),
    lambda: HardSwitch(),            # 'at' is required
    lambda: HardSwitch(at=-1),
    lambda: Linear(end_step=0),
    lambda: Fade(bogus=1),           # extra fields are forbidden
])
def test_invalid_schedules_rejected(bad):
    with pytest.raises(ValidationError):
        bad()


def test_schedule_union_round_trips_through_json():
    ta = TypeAdapter(Schedule)
    for s in (Constant(value=0.25), Linear(end_step=50), Fade(start_step=7, width=9, shape="concave"),
              HardSwitch(at=3)):
        back = ta.validate_json(ta.dump_json(s))
        assert type(back) is type(s) and back == s
    s = ta.validate_python({"kind": "fade", "shape": "two_step", "start_step": 0, "width": 10})
    assert isinstance(s, Fade) and s(5, 100) == 0.25


def test_schedules_are_frozen():
    f = Fade()
    with pytest.raises(ValidationError):
        f.width = 3


def test_settles_at_is_the_step_of_the_final_value():
    """The step a run must pass to follow the whole schedule (issue 30: fade600 on 200 steps never faded)."""
    assert Fade().settles_at == 1050 and Fade(start_step=100, width=7).settles_at == 107
    assert HardSwitch(at=1050).settles_at == 1050
    assert Linear().settles_at is None and Linear(end_step=90).settles_at == 90  # None: the final step, any budget
    assert Constant(value=0.3).settles_at == 0
    for s in (Fade(start_step=33, width=25), HardSwitch(at=29), Linear(end_step=90)):
        assert gate_value(s, s.settles_at, 10 ** 6) == gate_value(s, 10 ** 6, 10 ** 6)
        assert gate_value(s, s.settles_at - 1, 10 ** 6) != gate_value(s, 10 ** 6, 10 ** 6)


def test_schedules_describe_themselves_with_their_steps():
    assert Fade(start_step=33, width=25).describe() == "0.5 until step 33, linear fade to 0 by step 58"
    assert HardSwitch(at=29).describe() == "0.5 until step 29, then 0"
    assert Linear().describe() == "linear 0.5 -> 0 from step 0 to the final step"
