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
    union = np.concatenate(streams)                      # float64 naive statistics of everything
    prior = 1e-4 * len(streams)                          # each shard's tiny prior: mean 0, var 1
    n = len(union) + prior
    mean = union.sum(0) / n
    var = (((union - mean) ** 2).sum(0) + prior * (1.0 + mean ** 2)) / n
    np.testing.assert_allclose(merged["mean"], mean, rtol=1e-9)
    np.testing.assert_allclose(merged["var"], var, rtol=1e-9)
    assert abs(float(merged["count"]) - n) < 1e-9
    single = merge_running_stats(shards[:1])
    assert np.array_equal(single["mean"], shards[0]["mean"]) and np.array_equal(single["var"], shards[0]["var"])
