"""Seat assignment and the opponent pool: sampling rules, eviction, plain-data state."""

import json
from collections import Counter

import pytest

from ppokit.envs import CURRENT, OpponentPool, assign_seat
from ppokit.errors import UserError


def test_assign_seat_alternates_or_draws_from_the_seed():
    assert [assign_seat(i) for i in range(5)] == [0, 1, 0, 1, 0]
    assert [assign_seat(i, seed=1) for i in range(3)] == [1, 0, 1]
    assert [assign_seat(i, mode=1) for i in range(3)] == [1, 1, 1]
    drawn = [assign_seat(i, mode="random", seed=7) for i in range(4000)]
    assert drawn == [assign_seat(i, mode="random", seed=7) for i in range(4000)]
    assert drawn != [assign_seat(i, mode="random", seed=8) for i in range(4000)]
    assert drawn.count(0) / 4000 == pytest.approx(0.5, abs=0.04)
    assert {assign_seat(i, mode="random", num_seats=3) for i in range(100)} == {0, 1, 2}
    with pytest.raises(UserError, match="seat mode must be one of alternate, random"):
        assign_seat(0, mode="altern")
    with pytest.raises(UserError, match="seat 2 does not exist"):
        assign_seat(0, mode=2)


def _frequencies(pool, n=20000):
    counts = Counter(pool.sample() for _ in range(n))
    return {k: v / n for k, v in counts.items()}


def test_uniform_sampling():
    pool = OpponentPool(seed=0)
    for i in range(4):
        pool.add(f"it{i}", iteration=i)
    freq = _frequencies(pool)
    assert set(freq) == {"it0", "it1", "it2", "it3"}
    for k, p in pool.probabilities().items():
        assert p == 0.25 and freq[k] == pytest.approx(p, abs=0.015)


def test_latest_biased_sampling_and_the_current_policy():
    pool = OpponentPool(sampling="latest", latest_prob=0.6, current_prob=0.2, seed=1)
    for i in range(3):
        pool.add(f"it{i}")
    probs = pool.probabilities()
    assert probs == pytest.approx({CURRENT: 0.2, "it2": 0.8 * 0.6, "it0": 0.8 * 0.2, "it1": 0.8 * 0.2})
    assert sum(probs.values()) == pytest.approx(1.0)
    freq = _frequencies(pool)
    for k, p in probs.items():
        assert freq[k] == pytest.approx(p, abs=0.015)


def test_empty_pool():
    with pytest.raises(ValueError, match="the opponent pool is empty"):
        OpponentPool().sample()
    assert OpponentPool(current_prob=0.1).sample() == CURRENT
    single = OpponentPool(sampling="latest")
    single.add("only")
    assert {single.sample() for _ in range(20)} == {"only"}


def test_capacity_drops_the_oldest_unpinned_snapshot():
    pool = OpponentPool(capacity=3)
    assert pool.add("init", pinned=True) == []
    pool.add("a")
    pool.add("b")
    assert pool.add("c") == ["a"]
    assert pool.add("d") == ["b"]
    assert pool.ids() == ["init", "c", "d"] and "init" in pool and len(pool) == 3
    pool.remove("c")
    assert pool.ids() == ["init", "d"]
    with pytest.raises(KeyError):
        pool.remove("c")
    with pytest.raises(ValueError, match="already in the pool"):
        pool.add("d")
    with pytest.raises(ValueError, match="other than 'current'"):
        pool.add(CURRENT)


def test_state_dict_is_plain_data_and_restores_the_sampling_stream():
    pool = OpponentPool(sampling="latest", latest_prob=0.7, capacity=5, seed=3)
    for i in range(4):
        pool.add(f"it{i}", iteration=i * 10, path=f"snapshots/it{i}")
    pool.record("it0", "win")
    pool.record("it0", "loss")
    pool.record("it3", "draw")
    [pool.sample() for _ in range(5)]
    state = json.loads(json.dumps(pool.state_dict()))  # survives JSON: no tensors, no pickles
    expected = [pool.sample() for _ in range(50)]
    restored = OpponentPool()
    restored.load_state_dict(state)
    assert [restored.sample() for _ in range(50)] == expected
    assert restored.ids() == pool.ids() and restored.meta("it2") == {"iteration": 20, "path": "snapshots/it2"}
    assert restored.results() == {"it0": {"win": 1, "draw": 0, "loss": 1}, "it3": {"win": 0, "draw": 1, "loss": 0}}
    assert restored.capacity == 5 and restored.sampling == "latest"
    with pytest.raises(UserError, match="opponent pool state is incomplete or malformed"):
        restored.load_state_dict({"sampling": "uniform"})


def test_bad_settings():
    with pytest.raises(UserError, match="sampling must be one of uniform, latest"):
        OpponentPool(sampling="newest")
    with pytest.raises(UserError, match=r"latest_prob must be in \[0, 1\]"):
        OpponentPool(latest_prob=1.5)
    with pytest.raises(UserError, match="capacity must be a positive int"):
        OpponentPool(capacity=0)
    with pytest.raises(ValueError, match="outcome must be one of win, draw, loss"):
        OpponentPool().record("a", "won")
