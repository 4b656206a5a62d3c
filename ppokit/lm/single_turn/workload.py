"""The language-model workload: the components of PPO on a Hugging Face causal LM.

One iteration, as the run loop (:mod:`ppokit.loop`) drives it::

    LMSource.collect()       prompts.next_batch(); engine.generate(prompts, group_size)   # (N, P + R)
                             sequence rewards: reward model and/or reward function         # (N,)
    Scorer.score()           old/ref log-probs, values; token rewards (+ KL penalty)      # (N, R)
    advantages               GAE over tokens, or a group estimator (ppokit.trainer)
    LMLearner.update()       ppokit.trainer's epochs x mini-batches x micro-batches
    LMEvaluator              greedy held-out accuracy before, during and after training

Generation (:class:`~ppokit.lm.generation.engine.RolloutEngine`), scoring
(:class:`~ppokit.lm.scoring.Scorer`) and the update (:class:`LMLearner`) talk through a
:class:`~ppokit.components.Batch` of plain tensors and lists.

Precision: master weights, the optimizer and the loss math are float32; with
``run.precision`` = bf16 (``auto`` picks it where the hardware has native bf16)
generation, scoring and the update's forward/backward run under bf16 autocast, and
the frozen backbone is stored in bf16 (it has no master weights to keep). The
scoring pass runs the same code under the same autocast as the update, so the first
importance ratio is exactly 1 in bf16 too. On a CPU, ``model.cpu_kernels`` adds
ppokit's fused kernels (:mod:`ppokit.lm.accel`) once the policy is built.

The run directory gets ``base_model/`` (the built-in tiny model or the warm-started
model, when either is used; ``ppokit_base_model.json`` in it, written last, marks it
complete; a resume reuses it and does not warm-start again), and every checkpoint holds
the policy's files (:mod:`ppokit.lm.model.checkpoint`: adapters or models, value head,
tokenizer) beside the run loop's state (optimizer, schedule, RNGs, prompt position, KL
coefficient).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ppokit.components import Batch, Components
from ppokit.config import Config
from ppokit.errors import UserError
from ppokit.lm.data.inputs import chat_render, load_data
from ppokit.lm.evaluate import heldout_results
from ppokit.lm.model.device import one_thread_if_small, resolve_precision, run_device
from ppokit.lm.scoring import Scorer, kl_ref_metric
from ppokit.resume import all_finite, rollout_rngs
from ppokit.trainer import DataParallel, PPOTrainer

BASE_MODEL_DIR = "base_model"
BASE_MODEL_MARKER = "ppokit_base_model.json"  # in base_model/, written when it is complete
INIT_MODEL_DIR = "init_model"
KL_METRIC_ROWS = 64  # without a KL term, kl_ref is measured on this many sequences
# the batch tensors the update reads (ref_log_prob only with a KL term in the loss)
UPDATE_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "responses",
    "mask",
    "old_log_prob",
    "old_values",
    "advantages",
    "returns",
)


# ----------------------------------------------------------------------------- components
# the RNG stream of the rewards of a rollout that runs ahead (rollout.off_policy_steps=1)
REWARD_STREAM = 2**31


@dataclass
class RolloutPart:
    """What generation gives (in-process, or a rollout worker's shard): the sequences and,
    with ``rollout.off_policy_steps=1``, the sampling policy's log-probs of their tokens."""

    rollout: Any  # a ppokit.lm.generation.engine.RolloutBatch
    old_log_prob: torch.Tensor | None = None  # (N, R) behaviour log-probs, 0 on padding
    behaviour_time: float = 0.0


class LMSource:
    """Prompts in, scored responses out: ``collect() -> Batch``.

    Two steps: :meth:`collect_shard` generates (on a rollout worker, a shard of the
    prompts; there ``prompts`` and ``rewards`` are None) and :meth:`finish` scores the
    responses and measures them where the prompts' position and the rewards' state live
    (the training process). With ``rollout.off_policy_steps=1`` generation also returns
    the sampling (behaviour) policy's log-probs, computed by ``policy`` in the scorer's
    chunks right after generation: the update, one version later, takes its ratios
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
        self.pending: tuple[int, Batch] | None = None  # a prefetched iteration and its batch

    def collect(self, iteration: int) -> Batch:
        if self.pending is not None and self.pending[0] == iteration:
            batch, self.pending = self.pending[1], None
            return batch
        return self._collect(iteration, self.prompts.next_batch())

    def prefetch(self, iteration: int) -> None:
        """Collect ``iteration`` now (in this process nothing overlaps with the update)."""
        self.pending = (iteration, self._collect(iteration, self.prompts.next_batch()))

    def _collect(self, iteration: int, items: list[dict]) -> Batch:
        if not self.cfg.rollout.off_policy_steps:
            return self.finish(iteration, self.collect_shard(iteration, items))
        with rollout_rngs(self.cfg.seed, iteration):  # seeded per iteration: the same on a Ray worker
            part = self.collect_shard(iteration, items)
        return self.finish(iteration, part)

    def collect_shard(self, iteration: int, request: list[dict]) -> RolloutPart:
        """Responses to the prompt records ``request`` (``group_size`` each)."""
        rollout = self.engine.generate(
            [x["prompt"] for x in request], group_size=self.cfg.algo.group_size, items=request
        )
        if not self.cfg.rollout.off_policy_steps:
            return RolloutPart(rollout)
        start = time.perf_counter()
        old_log_prob = self.behaviour_log_probs(rollout.tensors())
        return RolloutPart(rollout, old_log_prob, time.perf_counter() - start)

    @torch.no_grad()
    def behaviour_log_probs(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N, R) log-probs of the sampled tokens under the sampling weights, 0 on padding."""
        from ppokit.lm.scoring import POLICY_INPUTS

        n, chunk = tensors["mask"].shape[0], self.cfg.train.infer_micro_batch_size
        parts = [
            self.policy.log_probs({k: tensors[k][s : s + chunk] for k in POLICY_INPUTS})["log_prob"]
            for s in range(0, n, chunk)
        ]
        return torch.cat(parts).float() * tensors["mask"]

    def finish(self, iteration: int, part: RolloutPart) -> Batch:
        """The batch of a rollout: sequence rewards (seeded per iteration when the rollout ran
        ahead), metrics and samples."""
        rollout = part.rollout
        seeded = (
            rollout_rngs(self.cfg.seed, iteration, REWARD_STREAM)
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
        lengths = rollout.response_lengths
        metrics = {
            "reward_mean": scores.mean().item(),
            "reward_std": scores.std(unbiased=False).item(),
            "reward_max": scores.max().item(),
            "response_length": lengths.mean().item(),
            "truncated_frac": rollout.truncated.float().mean().item(),
            "time_generate": rollout.generation_time,
            "time_reward": time_reward,
            "gen_tokens_per_s": lengths.sum().item() / max(rollout.generation_time, 1e-9),
            "data_epoch": self.prompts.epoch + self.prompts.position / len(self.prompts.items),
            **reward_metrics,
        }
        if self.dropped_prompts:
            metrics["prompts_dropped"] = float(self.dropped_prompts)
        tensors = {**rollout.tensors(), "scores": scores, "group_ids": rollout.group_ids}
        if part.old_log_prob is not None:
            tensors["old_log_prob"] = part.old_log_prob.to(self.device)
            metrics["time_behaviour_log_prob"] = part.behaviour_time
        return Batch(
            tensors=tensors,
            samples=rollout_samples(rollout, scores, self.cfg.run.log_samples, marks),
            metrics=metrics,
            policy_version=self.policy_version,
        )

    def sync_weights(self, learner: LMLearner) -> None:
        """Nothing to copy: generation runs the learner's own policy."""
        self.policy_version = learner.policy_version

    def load_rollout_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The actor adapter's weights (lora) or the actor model's (full), from ``rollout_weights``
        (all of them, or one bucket)."""
        self.policy.load_actor_weights(weights)

    def state_dict(self) -> dict[str, Any]:
        if self.prompts is None:  # a rollout worker's: nothing of its own
            return {}
        state: dict[str, Any] = {"prompts": self.prompts.state_dict(), "rewards": self.rewards.state_dict()}
        if self.pending is not None:
            state["pending"] = {"iteration": self.pending[0], "batch": self.pending[1].state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        if self.prompts is None:
            return []
        self.prompts.load_state_dict(state["prompts"])
        self.rewards.load_state_dict(state.get("rewards", {}))  # (absent in checkpoints before it existed)
        pending = state.get("pending")
        self.pending = (int(pending["iteration"]), Batch.from_state(pending["batch"])) if pending else None
        return []


class LMShardPlan:
    """The driver's side of N rollout workers: each iteration's prompts (drawn here, as
    in-process) go out in N contiguous slices of whole groups; the generated parts come
    back in that order, are padded to one layout (one worker: its part as it is) and
    scored here by the run's own source (:meth:`LMSource.finish`: rewards, their state,
    the prompts' position)."""

    steps_per_iteration = None

    def __init__(self, source: LMSource, num_shards: int):
        self.source, self.num_shards = source, num_shards

    def requests(self, iteration: int) -> list[list[dict]]:
        items = self.source.prompts.next_batch()
        k = len(items) // self.num_shards
        return [items[i * k : (i + 1) * k] for i in range(self.num_shards)]

    def merge(self, iteration: int, parts: list[RolloutPart], states: list[dict[str, Any]]) -> Batch:
        part = parts[0] if len(parts) == 1 else concat_parts(parts, self.source.engine.pad_id)
        return self.source.finish(iteration, part)

    def state_dict(self, shard_states: list[dict[str, Any]]) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> tuple[list[dict[str, Any] | None], list[str]]:
        return [None] * self.num_shards, self.source.load_state_dict(state)


def concat_parts(parts: list[RolloutPart], pad_id: int) -> RolloutPart:
    """One rollout from parts of different widths: prompts left-padded to the longest prompt
    P, responses right-padded to the longest response R (the layout of
    :mod:`ppokit.lm.generation.engine`); ``group_ids`` renumbered; the slowest part's generation time."""
    from ppokit.lm.generation.engine import RolloutBatch, position_ids_from

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
        cols.setdefault("truncated", []).append(r.truncated)
        cols.setdefault("group_ids", []).append(r.group_ids + offset)
        offset += int(r.group_ids.max()) + 1 if len(r.group_ids) else 0
    t = {k: torch.cat(v) for k, v in cols.items()}
    old_log_prob = t.pop("old_log_prob", None)
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
        generation_time=max(r.generation_time for r in rollouts),
    )
    return RolloutPart(merged, old_log_prob, max(p.behaviour_time for p in parts))


class LMLearner:
    """The policy's optimizer and the shared PPO update; the policy's files in each checkpoint."""

    def __init__(
        self,
        cfg: Config,
        policy,
        tokenizer,
        model_path: Path,
        parallel: DataParallel | None = None,
        *,
        num_mini_batches: int | None = None,
        horizon: int | None = None,
    ):
        self.cfg, self.policy, self.tokenizer, self.model_path = cfg, policy, tokenizer, model_path
        # multi-turn batches have a varying number of rows: a fixed number of mini-batches instead
        self.num_mini_batches = num_mini_batches
        # Dr.GRPO's constant: the generation budget, whatever the iteration's longest response
        self.trainer = PPOTrainer(
            cfg,
            policy,
            total_iterations=cfg.iterations,
            horizon=horizon or cfg.rollout.max_new_tokens,
            parallel=parallel,
        )
        self.keys = UPDATE_KEYS + (("ref_log_prob",) if needs_ref_log_prob(cfg) else ())
        self.policy_version = 0

    def needs_scored_old_log_prob(self) -> bool:
        """Whether the scorer must run the actor pass: not when the update makes one
        optimizer step (its own forward gives the old log-probs) and the rewards carry no
        KL term that needs them before the update."""
        return self.cfg.algo.use_kl_in_reward or not self.trainer.fully_on_policy(
            self.cfg.train.batch_size, self.num_mini_batches
        )

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        t = batch.tensors
        start = time.perf_counter()
        metrics = self.trainer.update(
            {k: t[k] for k in self.keys if k in t}, iteration, num_mini_batches=self.num_mini_batches
        )
        seconds = time.perf_counter() - start
        if "padding_frac" in metrics:  # before: fixed micro-batches of the batch's full width; after: computed
            metrics["padding_frac_before"] = 1.0 - float(t["attention_mask"].sum()) / t["attention_mask"].numel()
            metrics["padding_frac_after"] = metrics.pop("padding_frac")
        metrics["train_tokens_per_s"] = float(t["attention_mask"].sum()) * metrics["epochs"] / max(seconds, 1e-9)
        if "old_log_prob" not in t:  # fully on-policy: the update's own pass gave them
            t["old_log_prob"] = self.trainer.on_policy_log_prob * t["mask"]
        ref = t.get("ref_log_prob", batch.extras.get("ref_log_prob_metric"))  # (N or K, R)
        if ref is not None:
            metrics["kl_ref"] = kl_ref_metric(t["old_log_prob"], ref, t["mask"])
        self.policy_version += 1
        return metrics

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """lora: the actor adapter's weights only; full: the actor model's."""
        if self.policy.mode == "lora":
            from peft import get_peft_model_state_dict

            return get_peft_model_state_dict(self.policy.lm, adapter_name="actor")
        return self.policy.lm.state_dict()

    def trained_weights(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter by name (adapters and value head; full mode: the models')."""
        return {name: p.detach() for name, p in self.policy.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def load_trained_weights(self, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.policy.named_parameters())
        for name, value in weights.items():
            params[name].copy_(value)

    def weights_finite(self) -> bool:
        return all_finite(p for p in self.policy.parameters() if p.requires_grad)

    def state_dict(self) -> dict[str, Any]:
        return {"trainer": self.trainer.state_dict(), "policy_version": self.policy_version}

    def save_files(self, directory: Path) -> None:
        from ppokit.lm.model.checkpoint import save_policy

        save_policy(self.policy, directory, base_model=str(self.model_path), tokenizer=self.tokenizer)

    def load_state_dict(self, state: dict[str, Any], directory: Path | None) -> None:
        from ppokit.lm.model.checkpoint import load_trained_state

        if directory is not None:  # None: the weights come through load_trained_weights
            load_trained_state(self.policy, directory)
        self.trainer.load_state_dict(state["trainer"])
        self.policy_version = int(state.get("policy_version", 0))


class LMEvaluator:
    """Greedy held-out accuracy (mean reward of ``data.reward`` or the task's verifier):
    before training, every ``data.eval_every`` iterations and after training. ``reward``:
    the run's reward scorer (the reward pool: a failing or hanging sample gets
    ``data.reward_on_error`` and is counted as ``eval_reward_errors``)."""

    at_start = True

    def __init__(self, cfg: Config, engine, items: list[dict], reward):
        self.engine, self.items, self.reward = engine, items, reward
        self.every = cfg.data.eval_every
        self.max_reward_errors = cfg.data.max_reward_errors
        self.before: float | None = None

    def evaluate(self, phase: str) -> dict[str, float]:
        from ppokit.lm.rewards.pool import check_error_limit

        _, results = heldout_results(self.engine, self.items, self.reward)
        check_error_limit(results, self.max_reward_errors, getattr(self.reward, "name", "reward"))
        accuracy = sum(results.scores) / len(results.scores)
        if phase == "before":
            self.before = accuracy
        key = {"before": "eval_accuracy_before", "final": "eval_accuracy_after"}.get(phase, "eval_accuracy")
        out = {key: accuracy}
        if results.num_errors:
            out["eval_reward_errors"] = float(results.num_errors)
        return out

    def message(self, phase: str, metrics: dict[str, float]) -> str | None:
        if phase == "before":
            return f"held-out accuracy before PPO: {metrics['eval_accuracy_before']:.1%} ({len(self.items)} prompts)"
        if phase == "final":
            before = f" (before: {self.before:.1%})" if self.before is not None else ""
            return f"held-out accuracy after PPO: {metrics['eval_accuracy_after']:.1%}{before}"
        return None

    def stop_reason(self, metrics: dict[str, float]) -> str | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"before": self.before}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.before = state.get("before")

    def close(self) -> None:
        pass


class LMWorkload:
    """Builds the components of a language-model run (:class:`ppokit.components.Workload`)."""

    name = "lm"

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def check_inputs(self) -> None:
        """Prompts, held-out set, reward function and model directory, before a run directory exists."""
        from ppokit.lm.model.hf import causal_lm_config, load_tokenizer

        cfg = self.cfg
        train_items, eval_items, _ = load_data(cfg)
        if cfg.model.path != "tiny":
            causal_lm_config(cfg.model.path)
            load_tokenizer(cfg.model.path)
        if cfg.data.max_prompt_tokens is not None or cfg.train.micro_batch_tokens is not None:
            train_items, _, _ = drop_long(cfg, train_items, eval_items, [])
            check_token_budget(cfg, prompt_tokenizer(cfg), train_items)

    def check_checkpoint(self, meta: dict[str, Any], path: Path) -> None:
        from ppokit.lm.model.checkpoint import read_policy_meta

        read_policy_meta(path)  # the policy's files are there (a UserError names what is wrong)

    def shard_plan(self, components: Components, num_shards: int) -> LMShardPlan:
        return LMShardPlan(components.source, num_shards)

    def rollout_shard(self, shard: int, num_shards: int) -> LMSource:
        """Generation with the actor alone (lora: the backbone and the actor adapter), built as
        :meth:`build` builds it; the prompts come with each request, the rewards are the driver's."""
        from ppokit.lm.generation.engine import RolloutEngine
        from ppokit.lm.model.hf import load_tokenizer
        from ppokit.lm.model.policy import build_policy

        cfg = self.cfg
        device, autocast_dtype = setup(cfg)
        small_model_threads(cfg)
        tokenizer = load_tokenizer(self.model_path, "model.path")
        policy = build_policy(
            cfg,
            self.model_path,
            device=device,
            autocast_dtype=autocast_dtype,
            seed=cfg.seed,
            need_critic=False,
            need_reference=False,
        )
        kv_cache = accelerate(cfg, policy)[1]
        one_thread_if_small(cfg, policy, device)
        engine = RolloutEngine.for_policy(policy, tokenizer, cfg.rollout, kv_cache=kv_cache)
        return LMSource(cfg, engine, None, None, device, policy=policy)

    def learner_replica(self, parallel: DataParallel) -> LMLearner:
        """The policy (actor, critic; the reference only where the loss's exact KL reads it: the
        batch brings the reference's log-probs) and its optimizer, built as :meth:`build` builds
        them. Sharded learners (FSDP) build it in CPU memory: each rank moves its shards to its device."""
        from ppokit.lm.model.hf import load_tokenizer
        from ppokit.lm.model.policy import build_policy

        cfg = self.cfg
        device, autocast_dtype = setup(cfg)
        small_model_threads(cfg)
        tokenizer = load_tokenizer(self.model_path, "model.path")
        policy = build_policy(
            cfg,
            self.model_path,
            device=torch.device("cpu") if getattr(parallel, "shards", False) else device,
            autocast_dtype=autocast_dtype,
            seed=cfg.seed,
            need_reference=cfg.algo.beta > 0 and cfg.algo.kl_loss_type == "full",
        )
        accelerate(cfg, policy)
        one_thread_if_small(cfg, policy, device)
        return LMLearner(cfg, policy, tokenizer, self.model_path, parallel=parallel)

    def build(self, run_dir: Path) -> Components:
        cfg = self.cfg
        run_dir.mkdir(parents=True, exist_ok=True)
        device, autocast_dtype = setup(cfg)
        train_items, eval_items, reward_fn = load_data(cfg)
        header: list[str] = []
        closers: list[Any] = []
        train_items, eval_items, dropped = drop_long(cfg, train_items, eval_items, header)
        # the training reward: the reward model's score and/or a function's (the task's own only
        # without a reward model; held-out accuracy always uses the function)
        train_reward_fn = reward_fn if cfg.data.reward is not None or cfg.data.reward_model is None else None
        reward_model = None
        if cfg.data.reward_model is not None:  # loaded first: a bad one fails before a warm start runs
            from ppokit.lm.rewards.reward_model import RewardModel

            reward_model = RewardModel(
                cfg.data.reward_model,
                device=device,
                autocast_dtype=autocast_dtype,
                batch_size=cfg.train.infer_micro_batch_size,
                cpu_kernels=cfg.model.cpu_kernels,
            )
        verifier = None
        if reward_fn is not None:  # worker processes kept for the run, closed at its end
            verifier = reward_scorer(cfg, reward_fn)
            closers.append(verifier)
            header += reward_notes(reward_fn)
        try:
            return self._build(
                run_dir,
                device,
                autocast_dtype,
                train_items,
                eval_items,
                dropped,
                verifier,
                reward_model,
                train_reward_fn is not None,
                header,
                closers,
            )
        except BaseException:
            for closer in closers:
                closer.close()
            raise

    def _build(
        self,
        run_dir: Path,
        device,
        autocast_dtype,
        train_items,
        eval_items,
        dropped,
        verifier,
        reward_model,
        verifier_in_training: bool,
        header: list[str],
        closers: list[Any],
    ) -> Components:
        from ppokit import algo
        from ppokit.lm.data.sources import PromptIterator
        from ppokit.lm.generation.engine import RolloutEngine, check_prompts_fit
        from ppokit.lm.model.hf import causal_lm_config, load_tokenizer
        from ppokit.lm.model.policy import build_policy
        from ppokit.lm.rewards.sequence import SequenceRewards

        cfg, a = self.cfg, self.cfg.algo
        rewards = SequenceRewards(
            cfg.data,
            cfg.rollout.max_new_tokens,
            verifier=verifier if verifier_in_training else None,
            reward_model=reward_model,
        )
        model_path = prepare_model(cfg, run_dir, eval_items, verifier, _print, prompts=train_items + eval_items)
        self.model_path = model_path  # what rollout workers and learner ranks load
        causal_lm_config(model_path, "model.path")  # a clear error before anything heavy
        tokenizer = load_tokenizer(model_path, "model.path")
        policy = build_policy(cfg, model_path, device=device, autocast_dtype=autocast_dtype, seed=cfg.seed)
        accel_note, kv_cache = accelerate(cfg, policy)
        one_thread_if_small(cfg, policy, device)
        engine = RolloutEngine.for_policy(policy, tokenizer, cfg.rollout, kv_cache=kv_cache)
        check_prompts_fit(
            engine.model, tokenizer, [x["prompt"] for x in train_items + eval_items], cfg.rollout.max_new_tokens
        )  # every prompt, before the first rollout
        check_token_budget(cfg, tokenizer, train_items)
        learner = LMLearner(cfg, policy, tokenizer, model_path)
        kl_ctrl = (
            algo.make_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl, a.kl_ctrl.horizon)
            if a.use_kl_in_reward
            else None
        )
        scorer = Scorer(
            policy,
            cfg.train.infer_micro_batch_size,
            need_reference=needs_ref_log_prob(cfg),
            metric_rows=KL_METRIC_ROWS,
            need_old_log_prob=learner.needs_scored_old_log_prob(),
            kl_ctrl=kl_ctrl,
            kl_penalty=a.kl_penalty,
            micro_batch_tokens=cfg.train.micro_batch_tokens,
        )
        prompts = PromptIterator(train_items, cfg.train.batch_size // a.group_size, seed=cfg.seed)
        source = LMSource(cfg, engine, prompts, rewards, device, dropped_prompts=dropped, policy=policy)
        evaluator = LMEvaluator(cfg, engine, eval_items, verifier) if eval_items and verifier is not None else None
        precision = "bf16" if autocast_dtype is not None else "fp32"
        trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        header.insert(
            0,
            f"lm: {model_path} ({cfg.model.mode}, {trainable:,} trainable parameters), {device}, "
            f"{precision}{accel_note}, {cfg.iterations} iterations of {cfg.train.batch_size} sequences",
        )
        described = rewards.describe()
        if described:
            header.append(described)
        return Components(
            source=source,
            learner=learner,
            scorer=scorer,
            evaluator=evaluator,
            description=cfg.preset or "lm",
            header=header,
            closers=closers,
        )


# ----------------------------------------------------------------------------- building
def needs_ref_log_prob(cfg: Config) -> bool:
    """Whether the update reads the reference's token log-probs: a per-token KL estimator in
    the loss (``full`` computes its KL from the logits during the update)."""
    return cfg.algo.beta > 0 and cfg.algo.kl_loss_type != "full"


def setup(cfg: Config) -> tuple[torch.device, torch.dtype | None]:
    """Threads and every global RNG seeded; (device, autocast dtype or None) from ``run.device``/``run.precision``."""
    import random

    import numpy as np

    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    # every global RNG a reward function or sampler may draw from (all of them are checkpointed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    torch.manual_seed(cfg.seed)
    device = run_device(cfg)
    return device, resolve_precision(cfg.run.precision, device)


def small_model_threads(cfg: Config) -> None:
    """The built-in tiny model on a CPU without ``run.torch_threads``: one torch thread
    (what :func:`prepare_model` sets in the training process)."""
    if cfg.model.path == "tiny" and cfg.run.torch_threads is None and run_device(cfg).type == "cpu":
        torch.set_num_threads(1)


def accelerate(cfg: Config, policy) -> tuple[str, Any]:
    """``model.cpu_kernels``: ppokit's CPU kernels on ``policy``; (a note for the header, the
    generation cache factory or None)."""
    if not cfg.model.cpu_kernels:
        return "", None
    from ppokit.lm.accel import accelerate_policy

    acceleration = accelerate_policy(policy)
    return acceleration.describe(), acceleration.kv_cache


def prepare_model(
    cfg: Config,
    run_dir: Path,
    eval_items: list[dict],
    reward_fn,
    log,
    prompts: list[dict] | None = None,
    sft_examples: list[dict] | None = None,
) -> Path:
    """The backbone's directory: model.path, the built-in tiny model, and/or a warm-started copy.

    The warm start trains on ``sft_examples`` (prompt/completion records, rendered with
    the chat template here when ``data.chat_template`` is on) or, by default, the SFT
    split of ``data.prompts``.

    A complete ``RUN_DIR/base_model`` (its :data:`BASE_MODEL_MARKER` is written last) is
    reused as it is: a resumed run does not warm-start again. An incomplete one (a run
    killed while building it) is deleted and built again, deterministically.
    """
    import shutil

    path = cfg.model.path
    base = run_dir / BASE_MODEL_DIR
    if path == "tiny" or cfg.data.sft_epochs:
        small_model_threads(cfg)  # the built-in model is small (see SMALL_MODEL_PARAMS)
        if (base / BASE_MODEL_MARKER).is_file():
            return base
        for leftover in [base, *run_dir.glob(f".{BASE_MODEL_DIR}.*"), *run_dir.glob(f".{INIT_MODEL_DIR}.*")]:
            if leftover.is_dir():  # a killed build or warm start: start it over
                shutil.rmtree(leftover)
    if path == "tiny":
        from ppokit.lm.model.tiny import build_tiny_model

        target = run_dir / (INIT_MODEL_DIR if cfg.data.sft_epochs else BASE_MODEL_DIR)
        path = str(build_tiny_model(target, seed=cfg.seed, max_position_embeddings=tiny_positions(cfg, prompts or [])))
    if cfg.data.sft_epochs:
        from ppokit.lm.data.sources import load_prompts
        from ppokit.lm.sft import run_sft

        if not eval_items:
            raise UserError(
                "data.sft_epochs > 0 needs held-out prompts to pick the best warm-start model "
                "(a built-in task, or data.eval_prompts)"
            )
        examples = (
            sft_examples
            if sft_examples is not None
            else load_prompts(
                cfg.data.prompts,
                "sft",
                n=cfg.data.sft_examples,
                chat=cfg.data.chat_template,
                prompt_key=cfg.data.prompt_key,
                answer_key=cfg.data.answer_key,
            )
        )
        render = chat_render(cfg)
        if render is not None:
            from ppokit.lm.data.chat import render_records

            examples = render_records(examples, render)
        run_sft(
            path,
            run_dir / BASE_MODEL_DIR,
            examples,
            eval_items,
            epochs_max=cfg.data.sft_epochs,
            batch_size=cfg.data.sft_batch_size,
            learning_rate=cfg.data.sft_learning_rate,
            seed=cfg.seed,
            precision=cfg.run.precision,
            reward_fn=reward_fn,
            max_new_tokens=cfg.rollout.max_new_tokens,
            device=str(run_device(cfg)),
            log=log,
        )
        path = str(run_dir / BASE_MODEL_DIR)
    if path == str(base):
        marker = {"model.path": cfg.model.path, "data.sft_epochs": cfg.data.sft_epochs, "seed": cfg.seed}
        (base / BASE_MODEL_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return Path(path)


def tiny_positions(cfg: Config, prompts: list[dict]) -> int:
    """Positions of the built-in tiny model: ``model.tiny_max_positions``, else 64, or the longest
    prompt plus ``rollout.max_new_tokens`` rounded up to a multiple of 64 when that is more (rotary
    positions: the weights are the same whatever the count)."""
    from ppokit.lm.model.tiny import DEFAULT_TINY_SPEC, build_char_tokenizer

    if cfg.model.tiny_max_positions is not None:
        return cfg.model.tiny_max_positions
    texts = [p["prompt"] for p in prompts if isinstance(p.get("prompt"), str)]
    longest = max(count_tokens(build_char_tokenizer(), texts), default=0)
    need = longest + cfg.rollout.max_new_tokens
    base = DEFAULT_TINY_SPEC.max_position_embeddings
    return base if need <= base else -(-need // 64) * 64


def count_tokens(tokenizer, texts: list[str]) -> list[int]:
    from ppokit.lm.data.records import count_tokens_with

    return count_tokens_with(tokenizer)(texts) if texts else []


def drop_long(
    cfg: Config, train_items: list[dict], eval_items: list[dict], header: list[str]
) -> tuple[list[dict], list[dict], int]:
    """``data.max_prompt_tokens``: the training and held-out prompts within the limit (counted with
    model.path's tokenizer, the built-in character tokenizer for tiny), the number of training
    prompts dropped; a line for the header when any are."""
    limit = cfg.data.max_prompt_tokens
    if limit is None:
        return train_items, eval_items, 0
    from ppokit.lm.data.records import drop_long_prompts

    tokenizer = prompt_tokenizer(cfg)
    kept, dropped = drop_long_prompts(train_items, limit, tokenizer=tokenizer)
    eval_kept, eval_dropped = drop_long_prompts(eval_items, limit, tokenizer=tokenizer) if eval_items else ([], 0)
    if dropped or eval_dropped:
        header.append(
            f"data: dropped {dropped} of {len(train_items)} training and {eval_dropped} of "
            f"{len(eval_items)} held-out prompts longer than {limit} tokens (data.max_prompt_tokens)"
        )
    return kept, eval_kept, dropped


def prompt_tokenizer(cfg: Config):
    """The tokenizer prompts are counted with before the model is built."""
    if cfg.model.path == "tiny":
        from ppokit.lm.model.tiny import build_char_tokenizer

        return build_char_tokenizer()
    from ppokit.lm.model.hf import load_tokenizer

    return load_tokenizer(cfg.model.path, "model.path")


def check_token_budget(cfg: Config, tokenizer, items: list[dict]) -> None:
    """``train.micro_batch_tokens`` must hold the longest sequence a rollout can make."""
    budget = cfg.train.micro_batch_tokens
    if budget is None:
        return
    longest = max(count_tokens(tokenizer, [x["prompt"] for x in items]), default=0) + cfg.rollout.max_new_tokens
    if budget < longest:
        raise UserError(
            f"train.micro_batch_tokens={budget} is less than the longest sequence a rollout can make "
            f"({longest} tokens: the longest prompt plus rollout.max_new_tokens); raise it to at "
            f"least {longest}"
        )


def reward_scorer(cfg: Config, reward_fn):
    """The run's reward scorer for ``reward_fn`` (a RewardFunction): in this process for the cheap
    built-ins, else a pool of worker processes with ``data.reward_timeout`` per sample. The error
    limit is :class:`~ppokit.lm.rewards.sequence.SequenceRewards`' (over the run)."""
    from ppokit.lm.rewards.functions import BUILTIN_REWARDS
    from ppokit.lm.rewards.pool import make_reward_scorer

    d = cfg.data
    spec = reward_fn.spec if BUILTIN_REWARDS.get(reward_fn.spec) is reward_fn.fn else reward_fn
    return make_reward_scorer(
        spec,
        num_workers=d.reward_workers,
        timeout=d.reward_timeout,
        reward_on_error=d.reward_on_error,
        max_reward_errors=None,
    )


def reward_notes(reward_fn) -> list[str]:
    """Lines for the run's header: the code reward says how its programs are isolated (and warns,
    once, when the network is not cut off)."""
    if reward_fn.spec != "code":
        return []
    from ppokit.lm.rewards.sandbox import describe_isolation, isolation_warning

    warning = isolation_warning()
    return [describe_isolation()] + ([f"WARNING: {warning}"] if warning else [])


def rollout_samples(rollout, scores: torch.Tensor, k: int, marks: list[dict] | None = None) -> list[dict[str, Any]]:
    """The first ``k`` sequences of a rollout as JSON rows: prompt, response, sequence reward,
    response tokens, truncated, the prompt's data fields (``answer``, ...) and, from ``marks``,
    ``reward_error`` (why the reward function failed on it, or null) and ``reward_note``. The
    prompts are shuffled, so they are a random sample; with ``group_size`` > 1 they are one group."""
    from ppokit.lm.rewards.functions import reward_fields

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


def _print(text: str) -> None:
    """Progress lines before the tracker (and its progress bar) exists."""
    print(text, flush=True)
