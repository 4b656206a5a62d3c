"""trajectory_credit (token- and turn-level GAE) and trajectory_group_advantages (critic-free group
estimators over episodes) when a trajectory spans rows, against float64 references.

The batches are hand-built the way the multi-turn source lays them out: a trajectory is
one row per turn (state-mode environments) or one row holding the whole stream with
environment tokens between the turns (message mode); rows of different trajectories
interleave. The references walk each trajectory's turns as plain Python lists.
"""

import math
import random

import pytest
import torch

from ppokit.algo import step_group_advantages, trajectory_credit, trajectory_group_advantages
from ppokit.algo.turns import GROUP_ESTIMATORS
from ppokit.config import GROUP_ESTIMATORS as CONFIG_GROUP_ESTIMATORS


def build_batch(rng: random.Random, n_traj: int, T: int = 24):
    """Random trajectories as rows; returns tensors and the plain per-trajectory turns.

    A turn is a list of (reward, value) per action token. Rows of a "rows" trajectory
    hold one turn each (prompt tokens first); a "stream" trajectory is one row with
    1-3 environment tokens between turns. Rows are shuffled across trajectories, keeping
    each trajectory's own rows in order.
    """
    trajectories, rows = [], []
    for e in range(n_traj):
        kind = rng.choice(["rows", "stream"])
        n_turns = rng.randint(1, 4)
        turns = [[(rng.gauss(0, 1), rng.gauss(0, 1)) for _ in range(rng.randint(1, 3))] for _ in range(n_turns)]
        trajectories.append(turns)
        if kind == "rows":
            for k, turn in enumerate(turns):
                start = rng.randint(0, 3)
                rows.append((e, [(start + i, k, r, v) for i, (r, v) in enumerate(turn)]))
        else:
            t, cells = rng.randint(0, 2), []
            for k, turn in enumerate(turns):
                if k:
                    t += rng.randint(1, 3)
                for r, v in turn:
                    cells.append((t, k, r, v))
                    t += 1
            rows.append((e, cells))
    queues = [[i for i, (e, _) in enumerate(rows) if e == t] for t in range(n_traj)]
    order = []  # a random merge: trajectories interleave, each keeps its row order
    while any(queues):
        order.append(rng.choice([q for q in queues if q]).pop(0))
    N = len(rows)
    rewards = torch.randn(N, T, dtype=torch.float64)  # junk where the mask is 0: must be ignored
    values = torch.randn(N, T, dtype=torch.float64)
    mask = torch.zeros(N, T)
    turn_index = torch.full((N, T), -1, dtype=torch.long)
    traj_index = torch.zeros(N, dtype=torch.long)
    for n, i in enumerate(order):
        e, cells = rows[i]
        traj_index[n] = e
        for t, k, r, v in cells:
            rewards[n, t], values[n, t], mask[n, t], turn_index[n, t] = r, v, 1, k
    return rewards, values, mask, turn_index, traj_index, trajectories


def naive_token(turns, gamma, lam, last_value):
    flat = [rv for turn in turns for rv in turn]
    adv, running = [0.0] * len(flat), 0.0
    for i in reversed(range(len(flat))):
        v_next = flat[i + 1][1] if i + 1 < len(flat) else last_value
        delta = flat[i][0] + gamma * v_next - flat[i][1]
        running = delta + gamma * lam * running
        adv[i] = running
    out, i = [], 0
    for turn in turns:
        out.append([(adv[i + j], adv[i + j] + turn[j][1]) for j in range(len(turn))])
        i += len(turn)
    return out


def naive_turn(turns, gamma, lam, last_value):
    values = [turn[0][1] for turn in turns]
    rewards = [sum(r for r, _ in turn) for turn in turns]
    adv, running = [0.0] * len(turns), 0.0
    for k in reversed(range(len(turns))):
        v_next = values[k + 1] if k + 1 < len(turns) else last_value
        running = rewards[k] + gamma * v_next - values[k] + gamma * lam * running
        adv[k] = running
    return [[(adv[k], adv[k] + values[k])] * len(turn) for k, turn in enumerate(turns)]


def gather(adv, ret, mask, turn_index, traj_index, n_traj):
    """Per trajectory, per turn, the (advantage, return) of each action token in time order."""
    out = [[] for _ in range(n_traj)]
    for n in range(adv.shape[0]):
        e = int(traj_index[n])
        for t in range(adv.shape[1]):
            if mask[n, t]:
                k = int(turn_index[n, t])
                while len(out[e]) <= k:
                    out[e].append([])
                out[e][k].append((float(adv[n, t]), float(ret[n, t])))
    return out


@pytest.mark.parametrize("credit,naive", [("token", naive_token), ("turn", naive_turn)])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.3)])
def test_matches_float64_reference_across_rows(credit, naive, seed, gamma, lam):
    rng = random.Random(seed)
    E = 6
    rewards, values, mask, turn_index, traj_index, trajectories = build_batch(rng, E)
    truncated = torch.tensor([rng.random() < 0.5 for _ in range(E)])
    last_values = torch.randn(E, dtype=torch.float64)
    adv, ret = trajectory_credit(
        credit=credit,
        rewards=rewards,
        values=values,
        mask=mask,
        traj_index=traj_index,
        turn_index=turn_index,
        truncated=truncated,
        last_values=last_values,
        gamma=gamma,
        lam=lam,
    )
    assert adv.dtype == torch.float64
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)
    got = gather(adv, ret, mask, turn_index, traj_index, E)
    for e, turns in enumerate(trajectories):
        want = naive(turns, gamma, lam, float(last_values[e]) if truncated[e] else 0.0)
        for k in range(len(turns)):
            for (a, r), (a_ref, r_ref) in zip(got[e][k], want[k]):
                assert a == pytest.approx(a_ref, abs=1e-12)
                assert r == pytest.approx(r_ref, abs=1e-12)


def test_token_credit_bootstraps_across_row_boundaries_and_turn_credit_reads_first_tokens():
    # one trajectory, two turns in two rows: [p p a0 a0'] [p a1]; reward 1 at the end; gamma = lam = 1
    rewards = torch.tensor([[0, 0, 0.0, 0.0], [0, 1.0, 0, 0]], dtype=torch.float64)
    values = torch.tensor([[9, 9, 0.2, 0.4], [9, 0.6, 9, 9]], dtype=torch.float64)
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 0]])
    turn_index = torch.tensor([[-1, -1, 0, 0], [-1, 1, -1, -1]])
    traj = torch.tensor([0, 0])
    adv, _ = trajectory_credit(
        credit="token", rewards=rewards, values=values, mask=mask, traj_index=traj, gamma=1.0, lam=1.0
    )
    # Monte-Carlo return 1 everywhere: A_t = 1 - V_t
    assert adv[0, 2:].tolist() == pytest.approx([0.8, 0.6]) and adv[1, 1].item() == pytest.approx(0.4)
    adv, ret = trajectory_credit(
        credit="turn",
        rewards=rewards,
        values=values,
        mask=mask,
        traj_index=traj,
        turn_index=turn_index,
        gamma=1.0,
        lam=0.0,
    )
    # lam = 0: A_0 = r_0 + V_1 - V_0 = 0 + 0.6 - 0.2 (the turn's value is its first token's, not 0.4)
    assert adv[0, 2:].tolist() == pytest.approx([0.4, 0.4]) and adv[1, 1].item() == pytest.approx(0.4)
    assert ret[0, 2:].tolist() == pytest.approx([0.6, 0.6])


def test_bad_inputs_are_named():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="credit must be one of token, turn"):
        trajectory_credit(credit="step", rewards=z, values=z, mask=z, traj_index=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="needs turn_index"):
        trajectory_credit(credit="turn", rewards=z, values=z, mask=z + 1, traj_index=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="truncated trajectories need last_values"):
        trajectory_credit(
            credit="token",
            rewards=z,
            values=z,
            mask=z + 1,
            traj_index=torch.tensor([0, 1]),
            truncated=torch.tensor([True, False]),
        )
    bad_turns = torch.tensor([[1, 0, -1], [0, 0, 0]])
    with pytest.raises(ValueError, match="turn_index decreases"):
        trajectory_credit(
            credit="turn",
            rewards=z,
            values=z,
            mask=bad_turns >= 0,
            traj_index=torch.tensor([0, 1]),
            turn_index=bad_turns,
        )


# ----------------------------------------------------------------------------- group estimators over episodes
def naive_group(trajectories, groups, estimator, norm_by_std, eps=1e-6, batch_std=False):
    """Per trajectory, the advantage of each of its action tokens, as plain Python floats."""
    score = [sum(r for turn in turns for r, _ in turn) for turns in trajectories]
    all_mean = sum(score) / len(score)
    all_std = math.sqrt(sum((x - all_mean) ** 2 for x in score) / (len(score) - 1))
    adv = []
    for e, s in enumerate(score):
        members = [score[j] for j in range(len(score)) if groups[j] == groups[e]]
        n = len(members)
        mean = sum(members) / n
        if n == 1:
            a = 0.0
        elif estimator == "grpo":
            std = all_std if batch_std else math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
            a = (s - mean) / (std + eps) if norm_by_std else s - mean
        elif estimator == "rloo":
            a = s - (sum(members) - s) / (n - 1)
        else:  # reinforce_pp_baseline: centred, whitened over every action token below
            a = s - mean
        adv.append(a)
    tokens = [[adv[e]] * sum(len(t) for t in turns) for e, turns in enumerate(trajectories)]
    if estimator == "reinforce_pp_baseline":
        flat = [a for row in tokens for a in row]
        mu = sum(flat) / len(flat)
        var = sum((a - mu) ** 2 for a in flat) / (len(flat) - 1)
        tokens = [[(a - mu) / math.sqrt(var + 1e-8) for a in row] for row in tokens]
    return tokens


@pytest.mark.parametrize(
    "estimator,norm_by_std,batch_std",
    [
        ("grpo", True, False),
        ("grpo", True, True),
        ("grpo", False, False),
        ("rloo", True, False),
        ("reinforce_pp_baseline", True, False),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_advantages_of_episodes_match_a_float64_loop(estimator, norm_by_std, batch_std, seed):
    rng = random.Random(seed)
    E = 9
    rewards, _, mask, turn_index, traj_index, trajectories = build_batch(rng, E)
    groups = [0, 0, 0, 0, 1, 1, 1, 2, 3][:E]  # groups of 4, 3, 1 (no baseline: 0) and 1
    rng.shuffle(groups)  # a group's trajectories need not be next to each other
    adv, ret = trajectory_group_advantages(
        estimator=estimator,
        rewards=rewards,
        mask=mask,
        traj_index=traj_index,
        traj_group=torch.tensor(groups) * 7 + 3,  # any integers name the groups
        norm_by_std=norm_by_std,
        batch_std=batch_std,
    )
    assert adv.dtype == torch.float64 and torch.equal(adv, ret)
    assert torch.all(adv[mask == 0] == 0)
    got = gather(adv, ret, mask, turn_index, traj_index, E)
    want = naive_group(trajectories, groups, estimator, norm_by_std, batch_std=batch_std)
    for e in range(E):
        flat = [a for turn in got[e] for a, _ in turn]
        assert flat == pytest.approx(want[e], abs=1e-12)
    if estimator != "reinforce_pp_baseline":  # a group of one has no baseline
        for e in (e for e in range(E) if groups.count(groups[e]) == 1):
            assert all(a == 0 for turn in got[e] for a, _ in turn)


def test_group_advantages_ignore_rewards_off_the_action_tokens_and_the_row_split():
    # one episode as two rows (one per turn) or as one stream row: the same advantage on its tokens
    rewards = torch.tensor([[9.0, 0.0, 1.0], [9.0, 2.0, 0.0], [5.0, 5.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 0, 0]])
    adv, _ = trajectory_group_advantages(
        estimator="rloo",
        rewards=rewards,
        mask=mask,
        traj_index=torch.tensor([0, 0, 1]),
        traj_group=torch.tensor([0, 0]),
    )
    # scores 3 (not 21: the 9s are prompt tokens) and 5: A = 3 - 5 and 5 - 3 on the action tokens
    assert adv.tolist() == [[0.0, -2.0, -2.0], [0.0, -2.0, 0.0], [2.0, 0.0, 0.0]]


def test_group_estimators_are_the_configs_and_bad_inputs_are_named():
    assert GROUP_ESTIMATORS == CONFIG_GROUP_ESTIMATORS
    z, one = torch.zeros(2, 3), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="group estimator .*got 'gae'"):
        trajectory_group_advantages(estimator="gae", rewards=z, mask=z, traj_index=one, traj_group=one)
    with pytest.raises(ValueError, match=r"traj_group shape \(3,\) != \(E,\) = \(2,\)"):
        trajectory_group_advantages(
            estimator="grpo", rewards=z, mask=z + 1, traj_index=one, traj_group=torch.tensor([0, 0, 1])
        )


# ----------------------------------------------------------------------------- GiGPO: step groups by state
def naive_step(trajectories, states, gamma, norm_by_std, eps=1e-6):
    """Per trajectory, per turn, GiGPO's step advantage as plain Python floats: the turn's
    discounted return against the other turns taken from the same state id."""
    q = []
    for turns in trajectories:
        r = [sum(x for x, _ in turn) for turn in turns]
        q.append([sum(gamma ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))])
    members = {}
    for e, turns in enumerate(trajectories):
        for k in range(len(turns)):
            members.setdefault(states[e][k], []).append(q[e][k])
    out = []
    for e, turns in enumerate(trajectories):
        row = []
        for k in range(len(turns)):
            m = members[states[e][k]]
            n, mean = len(m), sum(m) / len(m)
            if n == 1:
                row.append(0.0)
                continue
            a = q[e][k] - mean
            if norm_by_std:
                a /= math.sqrt(sum((x - mean) ** 2 for x in m) / (n - 1)) + eps
            row.append(a)
        out.append(row)
    return out


@pytest.mark.parametrize("gamma,norm_by_std", [(1.0, True), (0.9, True), (0.95, False)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gigpo_step_and_episode_advantages_match_a_float64_loop(gamma, norm_by_std, seed):
    rng = random.Random(seed)
    E = 10
    rewards, _, mask, turn_index, traj_index, trajectories = build_batch(rng, E)
    groups = [0] * 5 + [1] * 4 + [2]
    K = max(len(t) for t in trajectories)
    # few state ids, so that turns share them; an id is only shared within a group (as the source keys them)
    states = [[groups[e] * 100 + rng.randint(0, 2) for _ in range(len(trajectories[e]))] for e in range(E)]
    turn_state = torch.full((E, K), -1, dtype=torch.long)
    for e in range(E):
        turn_state[e, : len(states[e])] = torch.tensor(states[e])
    step = step_group_advantages(
        rewards=rewards,
        mask=mask,
        traj_index=traj_index,
        turn_index=turn_index,
        turn_state=turn_state,
        gamma=gamma,
        norm_by_std=norm_by_std,
    )
    want = naive_step(trajectories, states, gamma, norm_by_std)
    assert step.dtype == torch.float64 and torch.all(step[mask == 0] == 0)
    got = gather(step, step, mask, turn_index, traj_index, E)
    for e in range(E):
        for k, turn in enumerate(got[e]):
            assert [a for a, _ in turn] == pytest.approx([want[e][k]] * len(turn), abs=1e-12)
    assert any(a != 0 for row in want for a in row)  # the draw shares states: the check has teeth
    # gigpo = grpo's episode advantage + w * the step advantage
    kwargs = dict(rewards=rewards, mask=mask, traj_index=traj_index, traj_group=torch.tensor(groups))
    episode, _ = trajectory_group_advantages(estimator="grpo", norm_by_std=norm_by_std, **kwargs)
    adv, ret = trajectory_group_advantages(
        estimator="gigpo",
        norm_by_std=norm_by_std,
        turn_index=turn_index,
        turn_state=turn_state,
        step_weight=0.5,
        gamma=gamma,
        **kwargs,
    )
    torch.testing.assert_close(adv, episode + 0.5 * step, rtol=0, atol=1e-12)
    assert torch.equal(adv, ret)


def test_gigpo_steps_from_unique_states_get_nothing_and_bad_inputs_are_named():
    # two one-row trajectories of two turns each: turn 0 from one shared state, turn 1 from states of their own
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1]])
    turn_index = torch.tensor([[0, 0, -1, 1], [0, -1, 1, 1]])
    rewards = torch.tensor([[0.0, 1.0, 7.0, 2.0], [3.0, 9.0, 0.0, -1.0]], dtype=torch.float64)
    turn_state = torch.tensor([[5, 6], [5, 7]])
    step = step_group_advantages(
        rewards=rewards,
        mask=mask,
        traj_index=torch.tensor([0, 1]),
        turn_index=turn_index,
        turn_state=turn_state,
        gamma=0.5,
        norm_by_std=False,
    )
    # Q: trajectory 0: turn 1 = 2, turn 0 = 1 + 0.5 * 2 = 2; trajectory 1: turn 1 = -1, turn 0 = 3 - 0.5 = 2.5
    assert step.tolist() == [[-0.25, -0.25, 0.0, 0.0], [0.25, 0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="gigpo' needs turn_index"):
        trajectory_group_advantages(
            estimator="gigpo",
            rewards=rewards,
            mask=mask,
            traj_index=torch.tensor([0, 1]),
            traj_group=torch.tensor([0, 0]),
        )
    with pytest.raises(ValueError, match="turn_state is -1 at a turn"):
        step_group_advantages(
            rewards=rewards,
            mask=mask,
            traj_index=torch.tensor([0, 1]),
            turn_index=turn_index,
            turn_state=torch.tensor([[5, -1], [5, 7]]),
        )
