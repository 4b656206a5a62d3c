"""The rollout source of a single-turn language-model run: prompts in, scored responses out.

:class:`LMSource` draws the iteration's prompts, generates ``group_size`` responses to each
(:mod:`ppokit.lm.generation`) and scores them with the sequence rewards
(:mod:`ppokit.lm.rewards.sequence`) into a :class:`~ppokit.components.Batch`. With rollout
workers (:mod:`ppokit.cluster`) the generation runs there in shards (:meth:`LMSource.collect_shard`)
and :class:`LMShardPlan` merges the parts on the driver, which scores them.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ppokit.components import Batch, RolloutQueue
from ppokit.config import Config
from ppokit.errors import UserError
from ppokit.lm.generation.engine import RolloutBatch, position_ids_from
from ppokit.lm.rewards.functions import reward_fields
from ppokit.lm.scoring import behaviour_log_probs
from ppokit.lm.single_turn.dynamic_sampling import DynamicSampler, check_filter_metric
from ppokit.persistence.resume import DRAW_STREAM, rollout_rngs

# the RNG stream of the rewards of a rollout that runs ahead (rollout.off_policy_steps >= 1)
REWARD_STREAM = 2**31


@dataclass
class RolloutPart:
    """What generation gives (in-process, or a rollout worker's shard): the sequences and,
    with ``rollout.off_policy_steps`` >= 1, the sampling policy's log-probs of their tokens."""

    rollout: Any  # a ppokit.lm.generation.engine.RolloutBatch
    old_log_prob: torch.Tensor | None = None  # (N, R) behaviour log-probs, 0 on padding
    behaviour_time: float = 0.0


class LMSource:
    """Prompts in, scored responses out: ``collect() -> Batch``.

    Two steps: :meth:`collect_shard` generates (on a rollout worker, a shard of the
    prompts; there ``prompts`` and ``rewards`` are None) and :meth:`finish` scores the
    responses and measures them where the prompts' position and the rewards' state live
    (the training process). With ``rollout.off_policy_steps`` >= 1 generation also returns
    the sampling (behaviour) policy's log-probs, computed by ``policy`` in the scorer's
    chunks right after generation: the update, up to k versions later, takes its ratios
    against them.
    """

    steps_per_iteration = None

    def __init__(
        self, cfg: Config, engine, prompts, rewards, device: torch.device, dropped_prompts: int = 0, policy=None
    ):
        self.cfg, self.engine, self.prompts = cfg, engine, prompts
        self.rewards, self.device = rewards, device  # a SequenceRewards
        self.dropped_prompts = dropped_prompts
        self.policy = policy
        self.policy_version = 0  # the learner's version of the actor's weights
        self.queue = RolloutQueue()  # iterations collected ahead (rollout.off_policy_steps)
        ds = cfg.rollout.dynamic_sampling
        # rollout.dynamic_sampling: the iteration's generation batches (the driver's; none on a rollout worker)
        self.sampler = DynamicSampler(cfg) if ds.enable and prompts is not None else None
        if self.sampler is not None:
            check_filter_metric(cfg, has_verifier=rewards.verifier is not None)

    def collect(self, iteration: int) -> Batch:
        batch = self.queue.pop(iteration)
        if batch is not None:
            return batch
        return self._collect(iteration, self.prompts.next_batch())

    def prefetch(self, iteration: int) -> None:
        """Collect ``iteration`` now, unless it is queued (in this process nothing overlaps
        with the update)."""
        if iteration not in self.queue:  # each iteration is drawn and generated once, in order
            self.queue.put(iteration, self._collect(iteration, self.prompts.next_batch()))

    def _collect(self, iteration: int, items: list[dict]) -> Batch:
        batch = self._draw(iteration, items)
        while batch is None:  # rollout.dynamic_sampling: too few groups with reward variance yet
            batch = self._draw(iteration, self.prompts.next_batch())
        return batch

    def _draw(self, iteration: int, items: list[dict]) -> Batch | None:
        if not self.cfg.rollout.off_policy_steps:
            return self.finish(iteration, self.collect_shard(iteration, items))
        draw = self.sampler.draw if self.sampler is not None else 0
        # seeded per iteration (and generation batch): the same on a Ray worker
        with rollout_rngs(self.cfg.seed, iteration, draw * DRAW_STREAM):
            part = self.collect_shard(iteration, items)
        return self.finish(iteration, part)

    def collect_shard(self, iteration: int, request: list[dict]) -> RolloutPart:
        """Responses to the prompt records ``request`` (``group_size`` each)."""
        rollout = self.engine.generate(
            [x["prompt"] for x in request], group_size=self.cfg.algo.group_size, items=request
        )
        if not self.cfg.rollout.off_policy_steps or self.cfg.algo.rollout_correction_bypass:
            return RolloutPart(rollout)  # bypass: the engine's rollout_log_prob are the behaviour log-probs
        start = time.perf_counter()
        old_log_prob = self.behaviour_log_probs(rollout.tensors())
        return RolloutPart(rollout, old_log_prob, time.perf_counter() - start)

    def behaviour_log_probs(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N, R) log-probs of the sampled tokens under the sampling weights, 0 on padding."""
        return behaviour_log_probs(self.policy, tensors, self.cfg.infer_micro_batch_size)

    def finish(self, iteration: int, part: RolloutPart) -> Batch | None:
        """The batch of a rollout: sequence rewards (seeded per iteration when the rollout ran
        ahead), metrics and samples. With ``rollout.dynamic_sampling``: None until the groups
        with reward variance fill the batch (the caller draws another generation batch), then
        the batch of the iteration's draws (:mod:`ppokit.lm.single_turn.dynamic_sampling`)."""
        rollout = part.rollout
        draw = self.sampler.draw if self.sampler is not None else 0
        seeded = (
            rollout_rngs(self.cfg.seed, iteration, REWARD_STREAM + draw)
            if self.cfg.rollout.off_policy_steps
            else contextlib.nullcontext()
        )
        start = time.perf_counter()
        with seeded:
            scores, reward_metrics, marks = self.rewards(rollout)  # (N,)
        scores = scores.to(self.device)
        time_reward = time.perf_counter() - start
        if not math.isfinite(scores.mean().item()):
            raise UserError(
                f"iteration {iteration}: reward_mean is {scores.mean().item()}; check the reward "
                "function (the metrics so far are in metrics.jsonl)"
            )
        sampled: dict[str, float] = {}
        if self.sampler is not None:
            values = scores if self.sampler.metric == "reward" else self.rewards.last_sources["verifier"]
            if not self.sampler.add(part, scores, values, marks, reward_metrics, time_reward):
                return None
            part, scores, marks, reward_metrics, time_reward, sampled = self.sampler.take(
                lambda parts: concat_parts(parts, self.engine.pad_id)
            )
            rollout = part.rollout
        lengths = rollout.response_lengths
        metrics = {
            "reward_mean": scores.mean().item(),
            "reward_std": scores.std(unbiased=False).item(),
            "reward_max": scores.max().item(),
            "response_length": lengths.mean().item(),
            "truncated_frac": rollout.truncated.float().mean().item(),
            "time_generate": rollout.generation_time,
            "memory/peak_gb/generate": rollout.generation_peak_gb,
            "time_reward": time_reward,
            "gen_tokens_per_s": lengths.sum().item() / max(rollout.generation_time, 1e-9),
            "data_epoch": self.prompts.epoch + self.prompts.position / len(self.prompts.items),
            **reward_metrics,
        }
        metrics.update(sampled)
        if self.dropped_prompts:
            metrics["prompts_dropped"] = float(self.dropped_prompts)
        tensors = {**rollout.tensors(), "scores": scores, "group_ids": rollout.group_ids}
        if part.old_log_prob is not None:
            tensors["old_log_prob"] = part.old_log_prob.to(self.device)
            metrics["time_behaviour_log_prob"] = part.behaviour_time
        if rollout.rollout_log_prob is not None:  # the engine's own: the trainer measures the mismatch
            tensors["rollout_log_prob"] = rollout.rollout_log_prob.to(self.device)
        held = self.engine.memory()
        if held.weights or held.cache:  # an engine with its own weights or cache (not the HF engine)
            metrics.update(held.metrics())
        return Batch(
            tensors=tensors,
            samples=rollout_samples(rollout, scores, self.cfg.run.log_samples, marks),
            metrics=metrics,
            policy_version=self.policy_version,
        )

    def sync_weights(self, learner) -> None:
        """The learner's new weights into the engine: nothing to copy when it samples with the
        learner's own policy (the HF engine), else ``learner.rollout_weights()`` through the seam."""
        if not self.engine.weights_shared:
            self.engine.load_weights(learner.rollout_weights())
        self.policy_version = learner.policy_version

    def load_rollout_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The actor adapter's weights (lora) or the actor model's (full), from ``rollout_weights``."""
        self.engine.load_weights(weights)

    def state_dict(self) -> dict[str, Any]:
        if self.prompts is None:  # a rollout worker's: nothing of its own
            return {}
        state: dict[str, Any] = {"prompts": self.prompts.state_dict(), "rewards": self.rewards.state_dict()}
        queued = self.queue.state_dict()
        if queued is not None:
            state["pending"] = queued
        if self.sampler is not None:
            state["dynamic_sampling"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        if self.prompts is None:
            return []
        self.prompts.load_state_dict(state["prompts"])
        self.rewards.load_state_dict(state.get("rewards", {}))  # (absent in checkpoints before it existed)
        self.queue.load_state_dict(state.get("pending"))
        if self.sampler is not None:
            self.sampler.load_state_dict(state.get("dynamic_sampling", {}))
        return []


class LMShardPlan:
    """The driver's side of N rollout workers: each iteration's prompts (drawn here, as
    in-process) go out in N contiguous slices of whole groups; the generated parts come
    back in that order, are padded to one layout (one worker: its part as it is) and
    scored here by the run's own source (:meth:`LMSource.finish`: rewards, their state,
    the prompts' position). With several rollouts in flight (``rollout.off_policy_steps``
    > 1) later prompts are drawn before a batch is merged: its ``data_epoch`` is the one
    after its own draw, as in-process."""

    steps_per_iteration = None

    def __init__(self, source: LMSource, num_shards: int):
        self.source, self.num_shards = source, num_shards
        self.drawn_epoch: dict[int, float] = {}  # iteration in flight -> data_epoch after its draw

    def requests(self, iteration: int) -> list[list[dict]]:
        prompts = self.source.prompts
        items = prompts.next_batch()
        self.drawn_epoch[iteration] = prompts.epoch + prompts.position / len(prompts.items)
        k = len(items) // self.num_shards
        return [items[i * k : (i + 1) * k] for i in range(self.num_shards)]

    def sync_weights(self, learner) -> None:
        """Nothing of the driver's own to update."""

    def merge(self, iteration: int, parts: list[RolloutPart], states: list[dict[str, Any]]) -> Batch | None:
        """The iteration's batch; None (``rollout.dynamic_sampling``) when it needs another
        generation batch: :class:`~ppokit.cluster.rollout_workers.RemoteSource` asks for new requests."""
        part = parts[0] if len(parts) == 1 else concat_parts(parts, self.source.engine.pad_id)
        batch = self.source.finish(iteration, part)
        if batch is None:
            return None
        if iteration in self.drawn_epoch:
            batch.metrics["data_epoch"] = self.drawn_epoch.pop(iteration)
        return batch

    def state_dict(self, shard_states: list[dict[str, Any]]) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> tuple[list[dict[str, Any] | None], list[str]]:
        return [None] * self.num_shards, self.source.load_state_dict(state)


def concat_parts(parts: list[RolloutPart], pad_id: int) -> RolloutPart:
    """One rollout from parts of different widths: prompts left-padded to the longest prompt
    P, responses right-padded to the longest response R (the layout of
    :mod:`ppokit.lm.generation.engine`); ``group_ids`` renumbered; the slowest part's generation time."""
    rollouts = [p.rollout for p in parts]
    widths = [(r.prompt_length, r.responses.shape[1]) for r in rollouts]
    P, R = max(w[0] for w in widths), max(w[1] for w in widths)
    pad = torch.nn.functional.pad
    cols: dict[str, list[torch.Tensor]] = {}
    offset = 0
    for part, r, (p, n) in zip(parts, rollouts, widths):
        for key, value in (("input_ids", pad_id), ("attention_mask", 0)):
            t = getattr(r, key)
            cols.setdefault(key, []).append(
                torch.cat([pad(t[:, :p], (P - p, 0), value=value), pad(t[:, p:], (0, R - n), value=value)], 1)
            )  # (n, P + R)
        cols.setdefault("responses", []).append(pad(r.responses, (0, R - n), value=pad_id))  # (n, R)
        cols.setdefault("mask", []).append(pad(r.mask, (0, R - n), value=0.0))
        if part.old_log_prob is not None:
            cols.setdefault("old_log_prob", []).append(pad(part.old_log_prob, (0, R - n), value=0.0))
        if r.rollout_log_prob is not None:
            cols.setdefault("rollout_log_prob", []).append(pad(r.rollout_log_prob, (0, R - n), value=0.0))
        cols.setdefault("truncated", []).append(r.truncated)
        cols.setdefault("group_ids", []).append(r.group_ids + offset)
        offset += int(r.group_ids.max()) + 1 if len(r.group_ids) else 0
    t = {k: torch.cat(v) for k, v in cols.items()}
    old_log_prob = t.pop("old_log_prob", None)
    rollout_log_prob = t.pop("rollout_log_prob", None)
    merged = RolloutBatch(
        input_ids=t["input_ids"],
        attention_mask=t["attention_mask"],
        position_ids=position_ids_from(t["attention_mask"]),
        responses=t["responses"],
        mask=t["mask"],
        truncated=t["truncated"],
        group_ids=t["group_ids"],
        prompts=[x for r in rollouts for x in r.prompts],
        texts=[x for r in rollouts for x in r.texts],
        items=[x for r in rollouts for x in r.items],
        rollout_log_prob=rollout_log_prob,
        generation_time=max(r.generation_time for r in rollouts),
        generation_peak_gb=max(r.generation_peak_gb for r in rollouts),
    )
    return RolloutPart(merged, old_log_prob, max(p.behaviour_time for p in parts))


def rollout_samples(rollout, scores: torch.Tensor, k: int, marks: list[dict] | None = None) -> list[dict[str, Any]]:
    """The first ``k`` sequences of a rollout as JSON rows: prompt, response, sequence reward,
    response tokens, truncated, the prompt's data fields (``answer``, ...) and, from ``marks``,
    ``reward_error`` (why the reward function failed on it, or null) and ``reward_note``. The
    prompts are shuffled, so they are a random sample; with ``group_size`` > 1 they are one group."""
    lengths = rollout.response_lengths
    rows = [
        {
            "prompt": rollout.prompts[i],
            "response": rollout.texts[i],
            "reward": float(scores[i]),
            "length": int(lengths[i]),
            "truncated": bool(rollout.truncated[i]),
            "fields": reward_fields(rollout.items[i]),
        }
        for i in range(min(k, len(rollout)))
    ]
    for row, mark in zip(rows, marks or []):
        row.update(mark)
    return rows
