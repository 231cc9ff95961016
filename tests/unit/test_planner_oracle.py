"""The clairvoyant scaler of ``app.bench.planner_oracle``: the load profile it reads and the pools it holds."""

from kvmesh.planning import Traffic

from app.bench.planner import SHAPES, Shape
from app.bench.planner_oracle import multiple, oracle_scaler
from app.fleet_sim import Sizes, Window

SHAPE = Shape("t", ((100, 1, 1), (100, 1, 3), (100, 3, 3)), surge_at=250 / 300, surge_s=20)


def window(t: float) -> Window:
    return Window(t, [], Traffic(0.0, 0.0, 0.0), Sizes(1, 1), 0.0, 0.0)


def test_the_profile_is_the_phases_multiple_plus_the_surge():
    assert multiple(SHAPE, 50) == 1 and multiple(SHAPE, 150) == 2 and multiple(SHAPE, 220) == 3
    assert multiple(SHAPE, 255) == 4  # the surge: another 1x for 20 s from 250 s
    assert multiple(SHAPE, 400) == 3  # past the end: the last phase's
    ramp = SHAPES["ramp"]
    assert multiple(ramp, 0) == 1 and multiple(ramp, 900) == 4


def test_it_holds_the_level_of_the_highest_multiple_an_instance_asked_for_now_would_meet():
    table = {1.0: Sizes(2, 1), 1.5: Sizes(3, 1), 2.0: Sizes(4, 2), 2.5: Sizes(5, 2), 3.0: Sizes(6, 3)}
    scale = oracle_scaler(SHAPE, table, Sizes(0, 0))()
    assert scale(window(0)) == Sizes(2, 1)  # 1x for the next 75 s
    assert scale(window(60)) == Sizes(4, 2)  # 1.7x at 135 s (the ramp from 1x to 3x): the 2x level
    assert scale(window(180)) == Sizes(8, 5)  # the surge at 250 s (4x): 3x's pools and one more a half multiple
    margin = oracle_scaler(SHAPE, table, Sizes(1, 2))()
    assert margin(window(0)) == Sizes(3, 3)
