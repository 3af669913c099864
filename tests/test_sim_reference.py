"""The serving simulation against results a step-by-step simulator recorded on fixed inputs."""
import json
import math

import pytest

import sim_reference as R

with open(R.REFERENCE) as f:
    RECORDED = json.load(f)


def assert_same(got, want, where):
    assert set(got) == set(want), where
    for key, value in want.items():
        if isinstance(value, float):
            assert math.isclose(got[key], value, rel_tol=1e-9, abs_tol=1e-12), (where, key)
        else:
            assert got[key] == value, (where, key)


@pytest.mark.parametrize("name", R.NAMES)
def test_simulation_reproduces_the_recorded_results(name):
    got = R.run(name)
    if got is None:
        pytest.skip("shared traces are not beside the project")
    assert set(got) == set(RECORDED[name])
    for label, summary in RECORDED[name].items():
        assert_same(got[label], summary, f"{name} {label}")
        if "peak_held" in got[label]:  # (the requests' written tokens at the peak add up to it)
            assert sum(got[label]["peak_contexts"]) == got[label]["peak_held"], (name, label)
