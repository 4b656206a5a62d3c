"""Multi-turn runs with group estimators (episodes of one seed as a group, no critic) and the
engine's behaviour log-probs carried into multi-turn batches (rollout correction).

Every test builds the real components (``MultiTurnWorkload.build``) on the small test model.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_multiturn_source import build, mt_config

from ppokit.lm.model.hf import load_tokenizer
from ppokit.lm.multi_turn.advantages import trajectory_advantages
from ppokit.lm.multi_turn.source import episode_seed, seat_actors_of
from ppokit.lm.multi_turn.turn_batch import trajectory_tensors
from ppokit.persistence.rundir import read_metrics
from ppokit.workloads import train

pytestmark = pytest.mark.filterwarnings("ignore:Seems like .optimizer.step:UserWarning")
GRPO4 = {"adv_estimator": "grpo", "group_size": 4, "gamma": 1.0, "gae_lambda": 1.0}


# ----------------------------------------------------------------------------- groups of episodes
def test_the_episodes_of_a_group_share_their_seed_and_seat_plan_and_groups_differ(tiny_dir, tmp_path):
    cfg = mt_config(
        tiny_dir,
        tmp_path,
        {"env": "tictactoe", "kwargs": {"opponent": "self"}, "max_turns": 9},
        algo=GRPO4,
        rollout={"max_new_tokens": 2},
    )
    source = build(cfg, tmp_path).source
    seeds, plans = source.episodes(3)
    assert len(seeds) == 8 and len(set(seeds[:4])) == 1 and len(set(seeds[4:])) == 1
    assert seeds[0] != seeds[4]
    assert seeds[0] == episode_seed(cfg.seed, 3, 0) and seeds[4] == episode_seed(cfg.seed, 3, 1)
    assert set(source.episodes(4)[0]).isdisjoint(seeds)  # another iteration, other seeds
    # self-play, seats alternating by group: one learner seat per group, the other group the other seat
    assert all(p == plans[0] for p in plans[:4]) and all(p == plans[4] for p in plans[4:])
    assert plans[0]["learner"] != plans[4]["learner"]
    plans[0]["learner"] = 9  # each episode has its own plan (the player may not alias them)
    assert plans[1]["learner"] != 9


def test_group_size_one_keeps_one_seed_per_episode(tiny_dir, tmp_path):
    source = build(mt_config(tiny_dir, tmp_path), tmp_path).source
    seeds, _ = source.episodes(2)
    assert seeds == [episode_seed(3, 2, i) for i in range(8)]


def naive_grpo(returns, groups, eps=1e-6):
    """GRPO per trajectory in float64 from plain lists."""
    out = []
    for e, s in enumerate(returns):
        members = [returns[j] for j in range(len(returns)) if groups[j] == groups[e]]
        n = len(members)
        mean = sum(members) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1)) if n > 1 else 0.0
        out.append((s - mean) / (std + eps) if n > 1 else 0.0)
    return out


@pytest.mark.parametrize("mode", ["state", "message"])
def test_grpo_over_episodes_of_one_seed_needs_no_critic(tiny_dir, tmp_path, mode):
    cfg = mt_config(tiny_dir, tmp_path, {"kwargs": {"observation_mode": mode}}, algo=GRPO4)
    c = build(cfg, tmp_path)
    assert not c.learner.policy.has_critic  # as single-turn group estimators: no critic adapter, no value head
    batch = c.source.collect(0)
    # every episode of a group was reset with the group's seed (Counter keeps it)
    envs = c.source.player.envs
    assert [env.seed for env in envs] == [episode_seed(cfg.seed, 0, i // 4) for i in range(8)]
    assert "bootstrap_input_ids" not in batch.extras  # truncated by max_turns, but no critic to bootstrap from
    groups = batch.extras["traj_group"].tolist()
    assert groups == [i // 4 for i in range(8)]  # one seat: the group of episode i is i // 4
    c.scorer.score(batch)
    t = batch.tensors
    adv, ret = trajectory_advantages(cfg, batch)
    assert torch.equal(adv, ret) and torch.all(adv[t["mask"] == 0] == 0)
    returns = [0.0] * 8
    for row, e in enumerate(t["traj_index"].tolist()):
        returns[e] += float((t["rewards"][row].double() * t["mask"][row]).sum())
    want = naive_grpo(returns, groups)
    for row, e in enumerate(t["traj_index"].tolist()):
        got = adv[row][t["mask"][row] == 1]
        assert got.numel() and torch.allclose(got.double(), torch.full_like(got, want[e], dtype=torch.float64))
    uniform = sum(len({returns[e] for e in range(8) if groups[e] == g}) == 1 for g in (0, 1)) / 2
    assert batch.metrics["env/uniform_group_rate"] == uniform


def contexts_of(batch):
    """(trajectory, turn) -> the token ids the policy answered at that turn, read off the batch."""
    t, out = batch.tensors, {}
    P = t["input_ids"].shape[1] - t["responses"].shape[1]
    for row, e in enumerate(t["traj_index"].tolist()):
        real = t["attention_mask"][row] == 1
        turns = t["turn_index"][row]
        for k in sorted(set(turns[turns >= 0].tolist())):
            start = P + int((turns == k).nonzero()[0])
            out[(e, k)] = tuple(t["input_ids"][row, :start][real[:start]].tolist())
    return out


@pytest.mark.parametrize("mode", ["state", "message"])
def test_gigpo_compares_the_turns_taken_from_one_context_within_a_group(tiny_dir, tmp_path, mode):
    algo = {**GRPO4, "adv_estimator": "gigpo", "gamma": 0.9, "step_advantage_weight": 0.5}
    cfg = mt_config(tiny_dir, tmp_path, {"kwargs": {"observation_mode": mode}}, algo=algo)
    c = build(cfg, tmp_path)
    assert not c.learner.policy.has_critic
    batch = c.source.collect(0)
    groups = batch.extras["traj_group"].tolist()
    state = batch.extras["turn_state"]  # (E, K)
    contexts = contexts_of(batch)
    # equal ids exactly where the group and the context are equal
    key = {ek: (groups[ek[0]], ctx) for ek, ctx in contexts.items()}
    for a in key:
        for b in key:
            assert (state[a] == state[b]) == (key[a] == key[b])
    assert all(int(state[e, k]) == -1 for e in range(8) for k in range(state.shape[1]) if (e, k) not in key)
    shared = [sum(key[ek] == v for v in key.values()) > 1 for ek in key]
    assert any(shared)  # a group's first observations are one seed's: its turn 0 is one state
    assert batch.metrics["env/shared_state_rate"] == pytest.approx(sum(shared) / len(shared))
    c.scorer.score(batch)
    t = batch.tensors
    adv, _ = trajectory_advantages(cfg, batch)
    # float64 reference: turn rewards, returns discounted by 0.9, GRPO per episode, step groups by key
    turn_r = dict.fromkeys(key, 0.0)
    for row, e in enumerate(t["traj_index"].tolist()):
        for col in (t["mask"][row] == 1).nonzero().flatten().tolist():
            turn_r[(e, int(t["turn_index"][row, col]))] += float(t["rewards"][row, col])
    q = {(e, k): sum(0.9 ** (j - k) * turn_r[(e, j)] for j in range(k, 9) if (e, j) in turn_r) for e, k in key}
    episode = naive_grpo([sum(r for (e2, _), r in turn_r.items() if e2 == e) for e in range(8)], groups)
    for row, e in enumerate(t["traj_index"].tolist()):
        for col in (t["mask"][row] == 1).nonzero().flatten().tolist():
            ek = (e, int(t["turn_index"][row, col]))
            peers = [q[o] for o in key if key[o] == key[ek]]
            step = 0.0
            if len(peers) > 1:
                mean = sum(peers) / len(peers)
                std = math.sqrt(sum((x - mean) ** 2 for x in peers) / (len(peers) - 1))
                step = (q[ek] - mean) / (std + 1e-6)
            assert float(adv[row, col]) == pytest.approx(episode[e] + 0.5 * step, abs=1e-4)


def test_a_multi_turn_gigpo_run_trains_and_logs_its_shared_states(tiny_dir, tmp_path):
    algo = {**GRPO4, "adv_estimator": "gigpo", "rollout_correction": "tis"}
    cfg = mt_config(tiny_dir, tmp_path, algo=algo, train={"iterations": 2}, run={"name": "run"})
    train(cfg, tmp_path / "run")
    rows = read_metrics(Path(tmp_path) / "run")
    assert len(rows) == 2 and all(0 < row["env/shared_state_rate"] <= 1 for row in rows)
    assert all("value_loss" not in row and math.isfinite(row["policy_loss"]) for row in rows)


# ----------------------------------------------------------------------------- behaviour log-probs
@pytest.mark.parametrize("mode", ["state", "message"])
def test_episodes_carry_the_engines_log_probs_on_the_models_tokens(tiny_dir, tmp_path, mode):
    cfg = mt_config(tiny_dir, tmp_path, {"kwargs": {"observation_mode": mode}})
    c = build(cfg, tmp_path)
    batch = c.source.collect(0)
    t = batch.tensors
    lp, mask = t["rollout_log_prob"], t["mask"]
    assert lp.shape == mask.shape and lp.dtype == torch.float32
    assert torch.all(lp[mask == 0] == 0)  # observation, prompt and padding tokens
    assert torch.all(lp[mask == 1] < 0)  # a sampled token's log-prob (temperature 1, no top-k/p)
    if mode == "message":  # one row per episode: observation tokens lie between the turns
        assert bool(((mask[:, :-1] == 1) & (mask[:, 1:] == 0) & (t["turn_index"][:, 1:] == -1)).any())
    c.scorer.score(batch)  # the trainer's scorer, fp32, on the same tokens
    old = t["old_log_prob"]
    torch.testing.assert_close(lp[mask == 1], old[mask == 1], atol=1e-4, rtol=0)


def test_greedy_episodes_carry_no_log_probs(tiny_dir, tmp_path):
    c = build(mt_config(tiny_dir, tmp_path), tmp_path)
    result = c.source.player.play(list(range(8)), seat_actors=seat_actors_of([{}] * 8), greedy=True)
    tensors, _ = trajectory_tensors(result.trajectories, mode="state", pad_id=0)
    assert "rollout_log_prob" not in tensors


def test_a_multi_turn_run_with_tis_logs_the_mismatch(tiny_dir, tmp_path):
    cfg = mt_config(
        tiny_dir, tmp_path, algo={"rollout_correction": "tis"}, train={"iterations": 1}, run={"name": "run"}
    )
    train(cfg, tmp_path / "run")
    [row] = read_metrics(Path(tmp_path) / "run")
    # the HF engine samples from the scorer's own fp32 distribution: a mismatch near 0, weights near 1
    assert 0 <= row["mismatch_kl"] < 1e-5
    assert abs(row["correction_weight_mean"] - 1) < 1e-3


# ----------------------------------------------------------------------------- dynamic sampling
def scripted(tok, answers_per_call):
    """A ``generate`` that answers call k's prompts with a digit (return 1 in Counter) where
    ``answers_per_call[k]`` has 1, else a letter (return 0)."""
    calls = []

    def generate(actor, prompts, greedy):
        answers = answers_per_call[len(calls)]
        calls.append(len(prompts))
        texts = ["7" if a else "x" for a in answers]
        return [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts], texts

    return generate


def returns_of(batch):
    t = batch.tensors
    out = [0.0] * int(batch.metrics["trajectories"])
    for row, e in enumerate(t["traj_index"].tolist()):
        out[e] += float(t["token_scores"][row].sum())
    return out


def test_dynamic_sampling_draws_new_seeds_until_the_groups_with_varying_returns_fill_the_batch(tiny_dir, tmp_path):
    cfg = mt_config(tiny_dir, tmp_path, {"max_turns": 1}, algo=GRPO4, rollout={"dynamic_sampling": True})
    c = build(cfg, tmp_path)
    tok = load_tokenizer(tiny_dir)
    # draw 0: group 0 all 1 (dropped), group 1 varies; draw 1: group 0 varies, group 1 all 0 (dropped)
    c.source.player.generate = scripted(tok, [[1, 1, 1, 1, 1, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0]])
    batch = c.source.collect(0)
    assert returns_of(batch) == [1, 0, 0, 0, 1, 0, 1, 0]  # draw 0's group 1, then draw 1's group 0
    assert batch.extras["traj_group"].tolist() == [0] * 4 + [1] * 4
    # the second draw played new seeds: groups 2 and 3 of the iteration
    assert [env.seed for env in c.source.player.envs] == [episode_seed(cfg.seed, 0, 2 + i // 4) for i in range(8)]
    m = batch.metrics
    assert m["dynamic_sampling/gen_batches"] == 2 and m["dynamic_sampling/episodes_generated"] == 16
    assert m["dynamic_sampling/kept_frac"] == 0.5 and m["dynamic_sampling/padded_groups"] == 0
    assert m["dynamic_sampling/return_mean_generated"] == 7 / 16
    assert m["env/uniform_group_rate"] == 0.0 and m["env/return_mean"] == 3 / 8  # the trained batch
    assert m["env/truncated_by_max_turns"] == 1.0  # every one of the 16 episodes played


def test_dynamic_sampling_at_its_limit_fills_the_batch_with_dropped_groups(tiny_dir, tmp_path):
    ds = {"enable": True, "max_gen_batches": 1}
    cfg = mt_config(tiny_dir, tmp_path, {"max_turns": 1}, algo=GRPO4, rollout={"dynamic_sampling": ds})
    c = build(cfg, tmp_path)
    c.source.player.generate = scripted(load_tokenizer(tiny_dir), [[1, 1, 1, 1, 1, 0, 0, 0]])
    batch = c.source.collect(0)
    assert returns_of(batch) == [1, 0, 0, 0, 1, 1, 1, 1]  # the kept group first, then the dropped one
    assert batch.metrics["dynamic_sampling/padded_groups"] == 1 and batch.metrics["env/uniform_group_rate"] == 0.5
    c.scorer.score(batch)
    adv, _ = trajectory_advantages(cfg, batch)
    assert torch.all(adv[4:] == 0) and adv[:4].abs().sum() > 0  # the padding has no signal (one row per episode)


def test_a_multi_turn_grpo_run_with_dynamic_sampling_trains_without_a_critic(tiny_dir, tmp_path):
    cfg = mt_config(
        tiny_dir,
        tmp_path,
        algo={**GRPO4, "rollout_correction": "tis"},
        rollout={"dynamic_sampling": {"enable": True, "max_gen_batches": 3}},
        train={"iterations": 2},
        run={"name": "run"},
    )
    train(cfg, tmp_path / "run")
    rows = read_metrics(Path(tmp_path) / "run")
    assert len(rows) == 2
    for row in rows:
        assert 1 <= row["dynamic_sampling/gen_batches"] <= 3 and "mismatch_kl" in row
        assert "value_loss" not in row and row["trajectories"] == 8


def test_a_multi_turn_run_in_bypass_mode_takes_the_carried_log_probs_as_old(tiny_dir, tmp_path):
    # algo.rollout_correction_bypass: no actor pass in the scorer, pi_old = the engine's log-probs
    cfg = mt_config(
        tiny_dir,
        tmp_path,
        {"kwargs": {"observation_mode": "message"}},
        algo={"rollout_correction_bypass": True},
        train={"iterations": 1},
        run={"name": "run"},
    )
    train(cfg, tmp_path / "run")
    [row] = read_metrics(Path(tmp_path) / "run")
    assert 0 <= row["mismatch_kl"] < 1e-5  # measured against the update's own forward
