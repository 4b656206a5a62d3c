"""Multi-turn trajectories as the batch layout of single-turn rollouts, with a per-token action mask.

The policy and the scorer read every row as ``[left-padded prompt (P) | response region (R),
right-padded]`` (:mod:`ppokit.lm.generation.engine`), one forward pass for all positions; a
multi-turn row uses the same layout. State mode: one row per turn (the prompt is the turn's
observation, the response its action; a trajectory spans rows). Message mode: one row per
trajectory (the prompt is the first observation, the response region ``action_0, obs_1 tokens,
action_1, ...``).

``mask`` is 1 on the model's tokens only (each turn's stop token included) and 0 on environment
tokens and padding, so that environment tokens never enter a ratio, an entropy, a KL or a value
loss; ``attention_mask`` is 1 on every real token. :func:`trajectory_tensors` gives the rows,
``token_scores`` (each turn's reward on its last action token), ``turn_index``, ``traj_index``, the
behaviour log-probs (``rollout_log_prob``, ``old_log_prob``) when every turn carries them, and the
prompts to bootstrap from; :func:`trajectory_rows` lays out the rows, :func:`turn_states` gives
GiGPO's per-turn states, :func:`attach_behaviour_log_probs` a Ray worker's ``old_log_prob``.
Every tensor and its shape: docs/multiturn.md, "The batch layout".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ppokit.lm.generation.base import left_pad
from ppokit.lm.generation.engine import position_ids_from
from ppokit.lm.multi_turn.episodes import Trajectory
from ppokit.lm.scoring import behaviour_log_probs

__all__ = ["attach_behaviour_log_probs", "trajectory_rows", "trajectory_tensors", "turn_states"]


def trajectory_rows(
    trajectories: Sequence[Trajectory], mode: str
) -> list[tuple[int, list[int], list[int], list[tuple[int, int, int, float, list[float] | None]]]]:
    """``(trajectory, prompt ids, response ids, [(start, end, turn, reward, log-probs)])`` per row;
    ``start:end`` is an action's span in the response ids, ``log-probs`` its tokens' behaviour
    log-probs (:attr:`TurnData.action_log_probs`, or None)."""
    rows = []
    for e, traj in enumerate(trajectories):
        if mode == "state":
            for k, turn in enumerate(traj.turns):
                span = (0, len(turn.action_ids), k, turn.reward, turn.action_log_probs)
                rows.append((e, turn.prompt_ids, turn.action_ids, [span]))
            continue
        stream = traj.stream
        first = stream.first_prompt_length
        spans = stream.action_spans[: len(traj.turns)]
        end = spans[-1][1]
        rows.append(
            (
                e,
                stream.ids[:first],
                stream.ids[first:end],
                [
                    (s - first, t - first, k, turn.reward, turn.action_log_probs)
                    for k, ((s, t), turn) in enumerate(zip(spans, traj.turns))
                ],
            )
        )
    return rows


def trajectory_tensors(
    trajectories: Sequence[Trajectory], *, mode: str, pad_id: int, device: torch.device | str = "cpu"
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(tensors, extras)`` of the module docstring."""
    rows = trajectory_rows(trajectories, mode)
    if not rows:
        raise ValueError("no trajectory has a turn to train on")
    prompt_ids, prompt_mask = left_pad([r[1] for r in rows], pad_id)  # (N, P)
    N, R = len(rows), max(len(r[2]) for r in rows)
    responses = torch.full((N, R), pad_id, dtype=torch.long)
    response_attention = torch.zeros((N, R), dtype=torch.long)
    mask = torch.zeros((N, R), dtype=torch.float32)
    token_scores = torch.zeros((N, R), dtype=torch.float32)
    turn_index = torch.full((N, R), -1, dtype=torch.long)
    traj_index = torch.tensor([r[0] for r in rows], dtype=torch.long)
    carried = all(span[4] is not None for r in rows for span in r[3])  # every turn has its log-probs
    rollout_log_prob = torch.zeros((N, R), dtype=torch.float32) if carried else None  # (N, R)
    behaved = all(trajectories[r[0]].turns[span[2]].behaviour_log_probs is not None for r in rows for span in r[3])
    old_log_prob = torch.zeros((N, R), dtype=torch.float32) if behaved else None  # (N, R)
    for n, (e, _, response, spans) in enumerate(rows):
        responses[n, : len(response)] = torch.tensor(response, dtype=torch.long)
        response_attention[n, : len(response)] = 1
        for start, end, turn, reward, log_probs in spans:
            mask[n, start:end] = 1.0
            turn_index[n, start:end] = turn
            token_scores[n, end - 1] += reward
            if rollout_log_prob is not None:
                rollout_log_prob[n, start:end] = torch.tensor(log_probs, dtype=torch.float32)
            if old_log_prob is not None:
                behaviour = trajectories[e].turns[turn].behaviour_log_probs
                old_log_prob[n, start:end] = torch.tensor(behaviour, dtype=torch.float32)
    attention_mask = torch.cat([prompt_mask, response_attention], 1)  # (N, P + R)
    tensors = {
        "input_ids": torch.cat([prompt_ids, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from(attention_mask),
        "responses": responses,
        "mask": mask,
        "token_scores": token_scores,
        "turn_index": turn_index,
        "traj_index": traj_index,
    }
    if rollout_log_prob is not None:
        tensors["rollout_log_prob"] = rollout_log_prob
    if old_log_prob is not None:
        tensors["old_log_prob"] = old_log_prob
    extras = {"traj_truncated": torch.tensor([t.truncated for t in trajectories], dtype=torch.bool)}
    boot = [(e, t.bootstrap_ids) for e, t in enumerate(trajectories) if t.bootstrap_ids is not None]
    if boot:
        ids, am = left_pad([b for _, b in boot], pad_id)
        extras.update(
            bootstrap_input_ids=ids,
            bootstrap_attention_mask=am,
            bootstrap_traj=torch.tensor([e for e, _ in boot], dtype=torch.long),
        )
    return {k: v.to(device) for k, v in tensors.items()}, {k: v.to(device) for k, v in extras.items()}


def turn_states(trajectories: Sequence[Trajectory], groups: Tensor, mode: str) -> Tensor:
    """(E, K) long: the anchor state of each trajectory's turn k for GiGPO's step groups
    (:func:`ppokit.algo.step_group_advantages`), -1 past its last turn. A state is the exact
    context the policy answered, within the trajectory's group (``groups`` (E,)): in state mode
    the turn's observation, in message mode the conversation so far (the same history)."""
    E = len(trajectories)
    K = max((len(t.turns) for t in trajectories), default=0)
    ids = torch.full((E, K), -1, dtype=torch.long)
    keys: dict[tuple[int, tuple[int, ...]], int] = {}
    group = groups.tolist()
    for e, prompt, response, spans in trajectory_rows(trajectories, mode):
        for start, _, turn, _, _ in spans:
            context = tuple(prompt) + tuple(response[:start])
            ids[e, turn] = keys.setdefault((group[e], context), len(keys))
    return ids


def attach_behaviour_log_probs(
    trajectories: Sequence[Trajectory], policy, *, mode: str, pad_id: int, chunk: int, device: torch.device | str
) -> None:
    """Each turn's :attr:`TurnData.behaviour_log_probs`: ``policy``'s log-probs of its action tokens
    now (:func:`ppokit.lm.scoring.behaviour_log_probs` over the rows of :func:`trajectory_tensors`,
    ``chunk`` rows a pass), so that :func:`trajectory_tensors` of these turns, merged with other
    workers' in episode order, gives the batch's ``old_log_prob``."""
    rows = trajectory_rows(trajectories, mode)
    if not rows:
        return
    tensors, _ = trajectory_tensors(trajectories, mode=mode, pad_id=pad_id, device=device)
    old = behaviour_log_probs(policy, tensors, chunk).cpu()  # (N, R)
    for n, (e, _, _, spans) in enumerate(rows):
        for start, end, turn, _, _ in spans:
            trajectories[e].turns[turn].behaviour_log_probs = old[n, start:end].tolist()
