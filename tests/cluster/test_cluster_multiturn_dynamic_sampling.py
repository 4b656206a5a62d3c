"""rollout.dynamic_sampling of multi-turn runs (textenv) on Ray rollout workers: the driver filters
each merged draw of episodes with the in-process code (``MultiTurnSource.finish_draw``) and sends
the workers the next draw's requests (groups ``d * B/G + j``: new seeds, the seat plans and the
pool's opponents drawn as in-process) until the groups whose returns vary fill the batch.

One worker carries the driver's RNG stream, so the run equals the in-process run bit for bit
(tic-tac-toe self-play against the pool, more than one draw in some iteration), and so does a
run resumed from a checkpoint; two workers play each further draw under their own seeded
streams and the batch is the first B/G kept groups in draw order.
"""

from __future__ import annotations

import shutil

import pytest
from cluster_helpers import DIST_ONLY, assert_rows_equal, run
from test_cluster_multiturn import SELF_PLAY, samples, textenv_cfg

from ppokit.lm.multi_turn import shards
from ppokit.lm.multi_turn.source import MultiTurnSource, episode_seed, groups_with_signal
from ppokit.persistence.rundir import periodic_checkpoint_path, read_metrics
from ppokit.workloads import train

pytestmark = pytest.mark.slow

B, G = 8, 4  # textenv_cfg's train.batch_size; groups of 4 episodes of one seed
DS = (
    "algo.adv_estimator=grpo",
    f"algo.group_size={G}",
    "algo.credit=token",
    "rollout.dynamic_sampling.enable=true",
    "rollout.dynamic_sampling.max_gen_batches=0",
)


def test_self_play_on_one_worker_with_dynamic_sampling_equals_in_process_and_resumes_exactly(
    tmp_path, cluster_clean, tiny_model_dir, monkeypatch
):
    """(Tic-tac-toe's start is the same for every seed: the draws' seeds are compared as drawn.)
    Both runs resumed from their checkpoint after iteration 2 (on the worker, and in one process):
    the draws, the pool and episodes_generated_total go on as in the uninterrupted run."""
    drawn = []  # (iteration, draw) of every draw's seeds and plans (MultiTurnSource.episodes)
    real_episodes = MultiTurnSource.episodes

    def episodes(self, iteration, draw=0):
        drawn.append((iteration, draw))
        return real_episodes(self, iteration, draw)

    monkeypatch.setattr(MultiTurnSource, "episodes", episodes)
    common = ("train.iterations=4", "run.checkpoint_every=2")
    cfgs = {"local": textenv_cfg(tiny_model_dir, SELF_PLAY, *DS, *common)}
    cfgs["remote"] = textenv_cfg(tiny_model_dir, SELF_PLAY, *DS, *common, "cluster.rollout_workers=1")
    local = run(cfgs["local"], tmp_path / "local")
    drawn_local, drawn[:] = list(drawn), []
    remote = run(cfgs["remote"], tmp_path / "remote")
    assert len(local) == 4 and any(r["dynamic_sampling/gen_batches"] > 1 for r in local[2:])  # further draws sent
    assert (
        drawn
        == drawn_local
        == [(r["iteration"], d) for r in local for d in range(int(r["dynamic_sampling/gen_batches"]))]
    )
    assert all(r["dynamic_sampling/padded_groups"] == 0 for r in local)
    assert_rows_equal(remote, local, extra=DIST_ONLY)
    assert samples(tmp_path / "remote") == samples(tmp_path / "local")
    assert sum(r["selfplay/vs_pool_episodes"] for r in remote) > 0  # the pool's opponents, drawn per draw
    for name, whole in (("remote", remote), ("local", local)):
        resumed = tmp_path / f"{name}-resumed"
        shutil.copytree(tmp_path / name, resumed)
        shutil.rmtree(resumed / "checkpoint")
        train(cfgs[name], resumed, resume_from=periodic_checkpoint_path(resumed, 2))
        assert_rows_equal(read_metrics(resumed), whole, extra=DIST_ONLY)
        assert samples(resumed) == samples(tmp_path / name)


def test_two_workers_fill_the_batch_with_the_first_groups_whose_returns_vary(
    tmp_path, cluster_clean, tiny_model_dir, monkeypatch
):
    """Each draw's requests are the in-process draw's seeds (episode_seed of group d * B/G + j), and
    the batch is the first B/G groups of the draws whose returns vary, in draw order."""
    draws, trained, sent = {}, {}, []
    real_finish_draw, real_finish, real_requests = (
        MultiTurnSource.finish_draw,
        MultiTurnSource.finish,
        shards.MultiTurnShardPlan.requests,
    )

    def finish_draw(self, iteration, result):
        draws.setdefault(iteration, []).append(result)
        return real_finish_draw(self, iteration, result)

    def finish(self, iteration, result, played=None):
        trained[iteration] = result
        return real_finish(self, iteration, result, played)

    def requests(self, iteration):
        out = real_requests(self, iteration)
        sent.append((iteration, [seed for r in out for seed in r.seeds]))
        return out

    monkeypatch.setattr(MultiTurnSource, "finish_draw", finish_draw)
    monkeypatch.setattr(MultiTurnSource, "finish", finish)
    monkeypatch.setattr(shards.MultiTurnShardPlan, "requests", requests)
    cfg = textenv_cfg(tiny_model_dir, SELF_PLAY, *DS, "cluster.rollout_workers=2")
    rows = run(cfg, tmp_path / "w2")
    assert len(rows) == 3 and any(r["dynamic_sampling/gen_batches"] > 1 for r in rows)
    draw_of = {}
    for iteration, seeds in sent:
        d = draw_of[iteration] = draw_of.get(iteration, -1) + 1
        assert seeds == [episode_seed(cfg.seed, iteration, d * (B // G) + i // G) for i in range(B)]
    for row in rows:
        i = row["iteration"]
        assert row["dynamic_sampling/gen_batches"] == len(draws[i]) == draw_of[i] + 1
        assert row["dynamic_sampling/episodes_generated"] == B * len(draws[i])
        assert row["dynamic_sampling/padded_groups"] == 0 and row["trajectories"] >= B
        keeps = [groups_with_signal(r.trajectories, G, B // G) for r in draws[i]]
        assert sum(map(sum, keeps[:-1])) < B // G <= sum(map(sum, keeps))  # drawn until the batch was full
        chosen = [(d, j) for d, keep in enumerate(keeps) for j in range(B // G) if keep[j]][: B // G]
        batch = trained[i]
        assert len(batch.records) == B and all(groups_with_signal(batch.trajectories, G, B // G))
        for k, (d, j) in enumerate(chosen):  # the kept groups' episodes, in draw order
            assert batch.records[k * G : (k + 1) * G] == draws[i][d].records[j * G : (j + 1) * G]
