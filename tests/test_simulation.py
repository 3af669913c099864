"""Experiment C: the slot schedulers, by hand and by invariant."""
import numpy as np
import pytest

from nn40.config import LENGTH_MAX, LENGTH_MU, LENGTH_SEED
from nn40.slot_steps import continuous_starts, simulate_slots
from nn40.workload import lognormal_lengths, read_lengths_file


def test_static_by_hand():
    # groups [5, 1] and [1, 1]: 5 + 1 steps; the second group starts at step 5
    sim = simulate_slots(np.array([5, 1, 1, 1]), 2, "static")
    assert sim["steps"] == 6
    assert sim["occupied"].tolist() == [2, 1, 1, 1, 1, 2]
    assert sim["occupancy"] == pytest.approx(8 / 12)


def test_continuous_by_hand():
    # slot 0 runs the 5; slot 1 runs the three 1s at steps 0, 1, 2
    sim = simulate_slots(np.array([5, 1, 1, 1]), 2, "continuous")
    assert sim["steps"] == 5
    assert sim["occupied"].tolist() == [2, 2, 2, 1, 1]
    assert sim["occupancy"] == pytest.approx(8 / 10)


def test_freed_slot_is_refilled_at_the_next_step():
    # the 2 ends after step 1; the waiting 3 takes its slot at step 2
    starts, steps = continuous_starts(np.array([4, 2, 3]), 2)
    assert starts.tolist() == [0, 0, 2]
    assert steps == 5


@pytest.mark.parametrize("seed", range(5))
def test_invariants(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, size=int(rng.integers(1, 400)))
    slots = int(rng.integers(1, 40))
    static = simulate_slots(lengths, slots, "static")
    continuous = simulate_slots(lengths, slots, "continuous")
    for sim in (static, continuous):
        assert sim["occupied"].sum() == lengths.sum()  # occupied slot-steps = tokens
        assert sim["occupied"].max() <= slots and sim["occupied"].min() >= 1
        assert len(sim["occupied"]) == sim["steps"]
    assert continuous["steps"] <= static["steps"]
    group_maxima = sum(lengths[i:i + slots].max() for i in range(0, len(lengths), slots))
    assert static["steps"] == group_maxima


def test_one_slot_and_more_slots_than_requests():
    lengths = np.array([7, 3, 9, 1])
    for policy in ("static", "continuous"):
        assert simulate_slots(lengths, 1, policy)["steps"] == lengths.sum()
        assert simulate_slots(lengths, 10, policy)["steps"] == lengths.max()


def test_lognormal_law_is_deterministic_and_clipped():
    a, b = lognormal_lengths(5000, 7), lognormal_lengths(5000, 7)
    assert (a == b).all()
    assert a.min() >= 1 and a.max() <= LENGTH_MAX
    assert abs(np.median(a) - np.exp(LENGTH_MU)) < 5


def test_the_default_law_draws_the_posts_lengths_and_table():
    lengths = lognormal_lengths(600, LENGTH_SEED)
    # NumPy's own draw, by the post's recipe
    expected = np.floor(np.random.default_rng(3).lognormal(mean=4.2, sigma=0.9, size=600))
    assert lengths.tolist() == expected.astype(int).tolist()
    assert (lengths.min(), np.median(lengths), lengths.max(), lengths.sum()) == \
        (3, 70.5, 1327, 62467)
    static = simulate_slots(lengths, 32, "static")
    continuous = simulate_slots(lengths, 32, "continuous")
    assert (static["steps"], round(100 * static["occupancy"], 1)) == (9602, 20.3)
    # the post prints 2,445 steps, but its own 79.9% (62,467 / (steps x 32)) needs 2,444
    assert (continuous["steps"], round(100 * continuous["occupancy"], 1)) == (2444, 79.9)
    assert round(static["steps"] / continuous["steps"], 2) == 3.93


def test_lengths_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# generated lengths\n12\n\n  7  # a comment\n300\n")
    assert read_lengths_file(str(path)).tolist() == [12, 7, 300]


@pytest.mark.parametrize("policy", ["static", "continuous"])
def test_binned_occupancy_is_the_mean_of_each_bin(policy):
    lengths = lognormal_lengths(3000, 2)
    exact = simulate_slots(lengths, 16, policy)
    binned = simulate_slots(lengths, 16, policy, max_points=500)
    per = binned["occupied_bin_steps"]
    assert per > 1 and len(binned["occupied"]) <= 500
    means = [exact["occupied"][i:i + per].mean() for i in range(0, exact["steps"], per)]
    np.testing.assert_allclose(binned["occupied"], means)


def test_more_slots_than_a_machine_has_memory_for():
    # a batch of 10^9 slots holds every request; nothing is sized by the slots
    sim = simulate_slots(np.array([5, 1, 1, 1]), 10**9, "static")
    assert sim["steps"] == 5 and sim["occupied"].tolist() == [4, 1, 1, 1, 1]
