"""Normalisation statistics of env shards merged (:func:`ppokit.control.workload.merge_running_stats`)."""

from __future__ import annotations

import numpy as np

from ppokit.control.envs import RunningMeanStd
from ppokit.control.workload import merge_running_stats


def test_merged_statistics_are_those_of_the_union():
    rng = np.random.default_rng(0)
    streams = [rng.normal(loc, 2.0, size=(n, 3)) for loc, n in ((0.0, 50), (3.0, 7), (-1.0, 200))]
    shards = []
    for stream in streams:
        rms = RunningMeanStd((3,))
        for chunk in np.array_split(stream, 5):
            rms.update(chunk)
        shards.append(rms.state_dict())
    merged = merge_running_stats(shards)
    union = np.concatenate(streams)  # float64 naive statistics of everything
    prior = 1e-4 * len(streams)  # each shard's tiny prior: mean 0, var 1
    n = len(union) + prior
    mean = union.sum(0) / n
    var = (((union - mean) ** 2).sum(0) + prior * (1.0 + mean**2)) / n
    np.testing.assert_allclose(merged["mean"], mean, rtol=1e-9)
    np.testing.assert_allclose(merged["var"], var, rtol=1e-9)
    assert abs(float(merged["count"]) - n) < 1e-9
    single = merge_running_stats(shards[:1])
    assert np.array_equal(single["mean"], shards[0]["mean"]) and np.array_equal(single["var"], shards[0]["var"])


def _shard_sources(num_shards: int, iterations: int):
    """``num_shards`` rollout-worker sources of the CartPole preset (4 envs), each after
    ``iterations`` collections."""
    from ppokit.config import load_config
    from ppokit.control.workload import ControlWorkload

    cfg = load_config("cartpole", ["env.num_envs=4", "env.num_steps=64"])
    workload = ControlWorkload(cfg)
    sources = [workload.rollout_shard(s, num_shards) for s in range(num_shards)]
    for it in range(iterations):
        for source in sources:
            source.collect(it)
    return sources


def _stats(state: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: np.asarray(v, np.float64) for k, v in state.items() if k.startswith(prefix)}


def test_env_states_move_between_shard_layouts():
    """Two shards' checkpoint loaded by one source and back by two: new episodes (a note
    says so), the normalisation statistics of the union, the episode record kept; split
    again, the shards' statistics merge back to the one source's."""
    from ppokit.control.workload import ControlShardPlan, merged_normalizer_state, regroup_env_states

    two = _shard_sources(2, 3)
    plan = ControlShardPlan(two[0].venv, 64, 2)
    state = plan.state_dict([s.state_dict() for s in two])
    assert len(state["shards"]) == 2
    finished = [s.venv.episodes_finished for s in two]
    returns = [list(s.venv.episode_returns) for s in two]
    assert min(finished) > 0  # episodes ended on both shards

    [one] = _shard_sources(1, 0)
    notes = one.load_state_dict(state)
    restarted = one.venv.env.unwrapped.state.copy()  # the new episodes' first states
    assert len(notes) == 1 and "2 shard(s)" in notes[0] and "not bit-identical" in notes[0]
    norm = one.venv.normalizer.state_dict()
    for prefix in ("obs_", "ret_"):
        want = merge_running_stats([_stats(s.venv.normalizer.state_dict(), prefix) for s in two])
        got = _stats(norm, prefix)
        for key in ("mean", "var", "count"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-12)
    assert one.venv.episodes_finished == sum(finished)
    assert list(one.venv.episode_returns) == (returns[0] + returns[1])[-one.venv.episode_returns.maxlen :]
    batch = one.collect(3)
    assert batch.tensors["obs"].shape[:2] == (4, 64) and batch.metrics["episodes"] >= 0
    [fresh] = _shard_sources(1, 0)
    fresh.venv.reset()
    assert not np.array_equal(restarted, fresh.venv.env.unwrapped.state)  # seeded apart from the first reset

    back, notes = regroup_env_states(one.state_dict(), 2)
    assert len(back) == 2 and len(notes) == 1
    halves = _shard_sources(2, 0)
    for source, shard_state in zip(halves, back):
        assert source.load_state_dict(shard_state) == []
    merged = merged_normalizer_state([s.venv.normalizer.state_dict() for s in halves])
    for key, value in one.venv.normalizer.state_dict().items():
        np.testing.assert_allclose(np.asarray(merged[key], np.float64), np.asarray(value, np.float64), rtol=1e-12)
    assert halves[0].venv.episodes_finished == one.venv.episodes_finished and halves[1].venv.episodes_finished == 0


def test_the_same_layout_keeps_the_states_as_they_are():
    from ppokit.control.workload import regroup_env_states

    two = _shard_sources(2, 1)
    states = [s.state_dict() for s in two]
    same, notes = regroup_env_states({"shards": states}, 2)
    assert notes == [] and [s["venv"]["episodes_finished"] for s in same] == [
        s["venv"]["episodes_finished"] for s in states
    ]
    assert not any(s.get("restart") for s in same)
