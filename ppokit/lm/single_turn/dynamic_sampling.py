"""DAPO's dynamic sampling for single-turn runs (``rollout.dynamic_sampling``).

:class:`DynamicSampler`, part of :class:`~ppokit.lm.single_turn.source.LMSource`, decides after
each scored generation batch of an iteration whether the iteration's batch is complete::

    draw 1, 2, ...   train.batch_size / group_size new prompts, group_size responses each, scored
    filter           keep the groups whose metric varies (ppokit.algo.dynamic_sampling: max > min;
                     metric = the sequence reward or the verifier's score)
    until            kept rows >= train.batch_size, or max_gen_batches drawn (0: no limit)
    batch            the first kept groups in draw order (the surplus discarded, as verl does); at
                     the limit, dropped groups in draw order fill the rest (zero group advantage)

At the limit the run goes on, where verl's DAPO recipe raises an error: a run is deterministic,
so a stopped run resumed from its checkpoint would draw the same prompts and stop again. Every
draw comes from the prompt stream and the run's RNGs (per-draw streams where the rollout runs
ahead, :data:`ppokit.persistence.resume.DRAW_STREAM`), so a resumed run draws the uninterrupted run's prompts
and samples; the only state across iterations is the count of generated samples. The iteration's
metrics describe the trained batch, merged over the draws (:func:`merge_draw_metrics`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ppokit.algo.dynamic_sampling import group_range, varied
from ppokit.errors import UserError


def check_filter_metric(cfg, has_verifier: bool) -> None:
    """A one-line :class:`UserError` when ``rollout.dynamic_sampling`` filters on the verifier's
    score and the run has none (a prompt file scored by ``data.reward_model`` alone)."""
    ds = cfg.rollout.dynamic_sampling
    if ds.enable and ds.metric == "verifier" and not has_verifier:
        raise UserError(
            "rollout.dynamic_sampling.metric=verifier filters on data.reward's score, but this run has no "
            "verifier (data.reward_model scores it): set rollout.dynamic_sampling.metric=reward, or data.reward"
        )


@dataclass
class Draw:
    """One scored generation batch of the iteration."""

    part: Any  # a ppokit.lm.single_turn.source.RolloutPart
    scores: torch.Tensor  # (N,) sequence rewards
    marks: list[dict[str, Any]]  # (N) reward error / note of each sample
    reward_metrics: dict[str, float]  # what the rewards measured on the draw
    time_reward: float
    keep: torch.Tensor  # (G,) bool: the group has variance
    groups: list[torch.Tensor]  # (G) each group's row indices, in row order
    constant: torch.Tensor  # (G,) the group's metric where it is constant (its minimum)


# reward metrics (ppokit.lm.rewards.sequence) that count events in a batch (summed over the
# draws) and that are running values over the run (the last draw's); the rest are means
# and shares of the batch's samples (averaged, weighted by rows)
_COUNT_KEYS = ("reward_errors",)
_COUNT_PREFIXES = ("reward_errors/", "reward_notes/")
_RUNNING_KEYS = ("reward_errors_total", "reward/running_std")


def merge_draw_metrics(metrics: list[dict[str, float]], rows: list[int]) -> dict[str, float]:
    """One iteration's reward metrics from its draws' (``rows[i]`` samples in draw i): counts
    (``reward_errors``, ``reward_errors/<kind>``, ``reward_notes/<note>``) summed, running
    values (``reward_errors_total``, ``reward/running_std``) the last draw's, every other key
    the row-weighted mean ``sum_i n_i m_i / sum_i n_i`` over the draws that logged it."""
    out: dict[str, float] = {}
    keys = dict.fromkeys(k for m in metrics for k in m)  # first-seen order
    for key in keys:
        have = [(m[key], n) for m, n in zip(metrics, rows) if key in m]
        if key in _COUNT_KEYS or key.startswith(_COUNT_PREFIXES):
            out[key] = float(sum(v for v, _ in have))
        elif key in _RUNNING_KEYS:
            out[key] = float(have[-1][0])
        else:
            out[key] = float(sum(v * n for v, n in have) / max(sum(n for _, n in have), 1))
    return out


def select_rows(part: Any, rows: torch.Tensor) -> Any:
    """The rows ``rows`` (long, (n,)) of a rollout part (sequences, behaviour and engine
    log-probs), group ids renumbered 0..; the part's timings kept."""
    r = part.rollout
    idx = rows.tolist()
    rows_on = {}
    for name in ("input_ids", "attention_mask", "position_ids", "responses", "mask", "truncated"):
        t = getattr(r, name)
        rows_on[name] = t[rows.to(t.device)]
    gids = r.group_ids[rows.to(r.group_ids.device)]
    rollout = dataclasses.replace(
        r,
        **rows_on,
        group_ids=torch.unique(gids, return_inverse=True)[1],  # (n,) 0..g-1, the order kept
        prompts=[r.prompts[i] for i in idx],
        texts=[r.texts[i] for i in idx],
        items=[r.items[i] for i in idx] if r.items else [],
        rollout_log_prob=None if r.rollout_log_prob is None else r.rollout_log_prob[rows.to(r.rollout_log_prob.device)],
    )
    old = None if part.old_log_prob is None else part.old_log_prob[rows.to(part.old_log_prob.device)]
    return dataclasses.replace(part, rollout=rollout, old_log_prob=old)


class DynamicSampler:
    """The draws of one iteration and the batch they make (module docstring).

    Metrics (``dynamic_sampling/...``): ``gen_batches`` drawn, ``samples_generated`` (and
    ``samples_generated_total`` over the run), ``kept_frac`` (the share of generated groups with
    variance), ``all_0_frac`` / ``all_1_frac`` / ``constant_other_frac`` (dropped groups whose metric
    was 0 everywhere, 1 everywhere, another constant), ``padded_groups``, ``reward_mean_generated``
    (the mean sequence reward of every generated sample: the policy's unfiltered reward).
    ``time_generate``, ``time_reward`` and ``gen_tokens_per_s`` count every draw.
    """

    def __init__(self, cfg):
        ds = cfg.rollout.dynamic_sampling
        self.metric = ds.metric
        self.max_draws = ds.max_gen_batches  # 0: no limit
        self.batch_size, self.group_size = cfg.train.batch_size, cfg.algo.group_size
        self.generated_total = 0  # samples generated over the run (checkpointed)
        self.draws: list[Draw] = []
        self.kept_rows = 0  # rows of the iteration's groups with variance so far

    @property
    def draw(self) -> int:
        """The index of the next generation batch of the iteration (0: its first)."""
        return len(self.draws)

    def add(
        self,
        part: Any,
        scores: torch.Tensor,
        values: torch.Tensor,
        marks: list[dict[str, Any]],
        reward_metrics: dict[str, float],
        time_reward: float,
    ) -> bool:
        """Take a scored generation batch (``scores`` (N,) its sequence rewards, ``values``
        (N,) the metric filtered on); True when the iteration's batch can be made (:meth:`take`)."""
        lo, hi, count, index = group_range(values.detach().cpu().double(), group_ids=part.rollout.group_ids.cpu())
        keep = varied(lo, hi, count)  # (G,)
        order = torch.argsort(index, stable=True)  # rows grouped, each group's rows in row order
        groups = list(torch.split(order, count.tolist()))
        self.draws.append(Draw(part, scores, marks, reward_metrics, time_reward, keep, groups, lo))
        self.kept_rows += int(count[keep].sum())
        return self.kept_rows >= self.batch_size or (self.max_draws > 0 and self.draw >= self.max_draws)

    def take(self, concat: Callable[[list[Any]], Any]) -> tuple[Any, torch.Tensor, list, dict, float, dict]:
        """The iteration's batch and what it measured: ``(part, scores (B,), marks, reward
        metrics, reward seconds, dynamic_sampling metrics)``; ``concat`` joins row selections of
        parts (:func:`ppokit.lm.single_turn.source.concat_parts`). Starts the next iteration."""
        want = self.batch_size // self.group_size  # groups in the batch
        kept = [(d, g) for d in self.draws for g in range(len(d.groups)) if d.keep[g]]
        dropped = [(d, g) for d in self.draws for g in range(len(d.groups)) if not d.keep[g]]
        chosen = kept[:want]
        padded = dropped[: want - len(chosen)]
        slices, scores, marks = [], [], []
        for pick in (chosen, padded):  # the kept groups, then the padding, each in draw order
            for d in self.draws:
                groups = [g for dd, g in pick if dd is d]
                if groups:
                    rows = torch.cat([d.groups[g] for g in groups])  # (n,)
                    slices.append(select_rows(d.part, rows))
                    scores.append(d.scores[rows.to(d.scores.device)])
                    marks += [d.marks[i] for i in rows.tolist()] if d.marks else []
        part = concat(slices)
        draw_parts = [d.part for d in self.draws]
        part.rollout.generation_time = sum(p.rollout.generation_time for p in draw_parts)
        part.rollout.generation_peak_gb = max(p.rollout.generation_peak_gb for p in draw_parts)
        part.behaviour_time = sum(p.behaviour_time for p in draw_parts)
        rows = [len(d.scores) for d in self.draws]
        generated = sum(rows)
        self.generated_total += generated
        groups = sum(len(d.groups) for d in self.draws)
        constant = torch.cat([d.constant[~d.keep] for d in self.draws])  # dropped groups' values
        all_0, all_1 = int((constant == 0).sum()), int((constant == 1).sum())
        tokens = sum(p.rollout.response_lengths.sum().item() for p in draw_parts)
        metrics = {
            "dynamic_sampling/gen_batches": float(len(self.draws)),
            "dynamic_sampling/samples_generated": float(generated),
            "dynamic_sampling/samples_generated_total": float(self.generated_total),
            "dynamic_sampling/kept_frac": len(kept) / groups,
            "dynamic_sampling/all_0_frac": all_0 / groups,
            "dynamic_sampling/all_1_frac": all_1 / groups,
            "dynamic_sampling/constant_other_frac": (len(dropped) - all_0 - all_1) / groups,
            "dynamic_sampling/padded_groups": float(len(padded)),
            "dynamic_sampling/reward_mean_generated": torch.cat([d.scores.double().cpu() for d in self.draws])
            .mean()
            .item(),
            "gen_tokens_per_s": tokens / max(part.rollout.generation_time, 1e-9),
        }
        reward_metrics = merge_draw_metrics([d.reward_metrics for d in self.draws], rows)
        time_reward = sum(d.time_reward for d in self.draws)
        self.draws, self.kept_rows = [], 0
        return part, torch.cat(scores), marks, reward_metrics, time_reward, metrics

    def state_dict(self) -> dict[str, Any]:
        return {"samples_generated_total": self.generated_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generated_total = int(state.get("samples_generated_total", 0))
