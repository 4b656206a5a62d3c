"""The language-model workload: the components of PPO on a Hugging Face causal LM.

One iteration, as the run loop (:mod:`ppokit.loop`) drives it::

    LMSource.collect()       prompts.next_batch(); engine.generate(prompts, group_size)   # (N, P + R)
                             sequence rewards: reward model and/or reward function         # (N,)
    Scorer.score()           old/ref log-probs, values; token rewards (+ KL penalty)      # (N, R)
    advantages               GAE over tokens, or a group estimator (ppokit.trainer)
    LMLearner.update()       ppokit.trainer's epochs x mini-batches x micro-batches
    LMEvaluator              greedy held-out accuracy before, during and after training

Generation (:class:`~ppokit.lm.rollout.RolloutEngine`), scoring
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
the policy's files (:mod:`ppokit.lm.policy_io`: adapters or models, value head,
tokenizer) beside the run loop's state (optimizer, schedule, RNGs, prompt position, KL
coefficient).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional

import torch

from ppokit.components import Batch, Components
from ppokit.config import Config
from ppokit.errors import UserError
from ppokit.lm.device import one_thread_if_small, resolve_precision, run_device
from ppokit.lm.evaluate import heldout_accuracy
from ppokit.lm.prompts import chat_render, load_data
from ppokit.lm.scoring import Scorer, kl_ref_metric
from ppokit.resume import all_finite, rollout_rngs
from ppokit.trainer import DataParallel, PPOTrainer

BASE_MODEL_DIR = "base_model"
BASE_MODEL_MARKER = "ppokit_base_model.json"   # in base_model/, written when it is complete
INIT_MODEL_DIR = "init_model"
KL_METRIC_ROWS = 64               # without a KL term, kl_ref is measured on this many sequences
# the batch tensors the update reads (ref_log_prob only with a KL term in the loss)
UPDATE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "mask", "old_log_prob", "old_values",
               "advantages", "returns")


# ----------------------------------------------------------------------------- components
class LMSource:
    """Prompts in, scored responses out: ``collect() -> Batch``.

    Also a rollout worker's source (:class:`ppokit.components.ShardSource`, ``prompts``
    None): :meth:`collect_shard` answers the prompts it is sent with its own policy copy.
    With ``rollout.off_policy_steps=1`` the rollout's ``old_log_prob`` are the sampling
    (behaviour) policy's, computed right after generation by ``policy`` in the scorer's
    chunks and code: the update, one version later, takes its ratios against them.
    """

    steps_per_iteration = None

    def __init__(self, cfg: Config, engine, prompts, reward_model, reward_fn, device: torch.device, policy=None):
        self.cfg, self.engine, self.prompts = cfg, engine, prompts
        self.reward_model, self.reward_fn, self.device = reward_model, reward_fn, device
        self.policy = policy
        self.policy_version = 0                    # the learner's version of the actor's weights
        self.pending: Optional[tuple[int, Batch]] = None    # a prefetched iteration and its batch

    def collect(self, iteration: int) -> Batch:
        if self.pending is not None and self.pending[0] == iteration:
            batch, self.pending = self.pending[1], None
            return batch
        return self._collect(iteration, self.prompts.next_batch())

    def prefetch(self, iteration: int) -> None:
        """Collect ``iteration`` now (in this process nothing overlaps with the update)."""
        self.pending = (iteration, self._collect(iteration, self.prompts.next_batch()))

    def _collect(self, iteration: int, items: list[dict]) -> Batch:
        if self.cfg.rollout.off_policy_steps:     # seeded per iteration: the same on a Ray worker
            with rollout_rngs(self.cfg.seed, iteration):
                return self.collect_shard(iteration, items)
        return self.collect_shard(iteration, items)

    def collect_shard(self, iteration: int, request: list[dict]) -> Batch:
        """Responses to the prompt records ``request`` (``group_size`` each), with their rewards."""
        items = request
        rollout = self.engine.generate([x["prompt"] for x in items], group_size=self.cfg.algo.group_size,
                                       items=items)
        start = time.perf_counter()
        scores, reward_parts = sequence_scores(rollout, self.reward_model, self.reward_fn, self.device)   # (N,)
        time_reward = time.perf_counter() - start
        if not math.isfinite(scores.mean().item()):
            raise UserError(f"iteration {iteration}: reward_mean is {scores.mean().item()}; check the reward "
                            "function (the metrics so far are in metrics.jsonl)")
        lengths = rollout.response_lengths
        metrics = {"reward_mean": scores.mean().item(), "reward_std": scores.std(unbiased=False).item(),
                   "reward_max": scores.max().item(), "response_length": lengths.mean().item(),
                   "truncated_frac": rollout.truncated.float().mean().item(),
                   "time_generate": rollout.generation_time, "time_reward": time_reward,
                   "gen_tokens_per_s": lengths.sum().item() / max(rollout.generation_time, 1e-9), **reward_parts}
        tensors = {**rollout.tensors(), "scores": scores, "group_ids": rollout.group_ids}
        if self.cfg.rollout.off_policy_steps:
            start = time.perf_counter()
            tensors["old_log_prob"] = self.behaviour_log_probs(tensors)
            metrics["time_behaviour_log_prob"] = time.perf_counter() - start
        return Batch(tensors=tensors, samples=rollout_samples(rollout, scores, self.cfg.run.log_samples),
                     metrics=metrics, policy_version=self.policy_version)

    @torch.no_grad()
    def behaviour_log_probs(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """(N, R) log-probs of the sampled tokens under the sampling weights, 0 on padding."""
        from ppokit.lm.scoring import POLICY_INPUTS

        n, chunk = tensors["mask"].shape[0], self.cfg.train.infer_micro_batch_size
        parts = [self.policy.log_probs({k: tensors[k][s:s + chunk] for k in POLICY_INPUTS})["log_prob"]
                 for s in range(0, n, chunk)]
        return torch.cat(parts) * tensors["mask"]

    def sync_weights(self, learner: "LMLearner") -> None:
        """Nothing to copy: generation runs the learner's own policy."""
        self.policy_version = learner.policy_version

    def load_rollout_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The actor adapter's weights (lora) or the actor model's (full), from ``rollout_weights``."""
        if self.policy.mode == "lora":
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.policy.lm, weights, adapter_name="actor")
            if getattr(result, "unexpected_keys", None):
                raise RuntimeError(f"rollout weights not in the actor adapter: {result.unexpected_keys[:3]}")
        else:
            self.policy.lm.load_state_dict(weights)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"prompts": self.prompts.state_dict()} if self.prompts is not None else {}
        if self.pending is not None:
            state["pending"] = {"iteration": self.pending[0], "batch": self.pending[1].state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        if self.prompts is not None:
            self.prompts.load_state_dict(state["prompts"])
        pending = state.get("pending")
        self.pending = (int(pending["iteration"]), Batch.from_state(pending["batch"])) if pending else None
        return []


class LMShardPlan:
    """The driver's side of N rollout workers: each iteration's prompts (drawn here, as
    in-process) go out in N contiguous slices of whole groups; the parts come back in
    that order, padded to one layout (one worker: its batch as it is)."""

    steps_per_iteration = None

    def __init__(self, prompts, num_shards: int, pad_id: int, log_samples: int):
        self.prompts, self.num_shards, self.pad_id, self.log_samples = prompts, num_shards, pad_id, log_samples

    def requests(self, iteration: int) -> list[list[dict]]:
        items = self.prompts.next_batch()
        k = len(items) // self.num_shards
        return [items[i * k:(i + 1) * k] for i in range(self.num_shards)]

    def merge(self, parts: list[Batch], states: list[dict[str, Any]]) -> Batch:
        return parts[0] if len(parts) == 1 else concat_lm_batches(parts, self.pad_id, self.log_samples)

    def state_dict(self, shard_states: list[dict[str, Any]]) -> dict[str, Any]:
        return {"prompts": self.prompts.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> tuple[list[Optional[dict[str, Any]]], list[str]]:
        self.prompts.load_state_dict(state["prompts"])
        return [None] * self.num_shards, []


def concat_lm_batches(parts: list[Batch], pad_id: int, log_samples: int) -> Batch:
    """One batch from rollout parts of different widths: prompts left-padded to the longest
    prompt P, responses right-padded to the longest response R (the layout of
    :mod:`ppokit.lm.rollout`); ``group_ids`` renumbered; metrics over all sequences."""
    from ppokit.lm.rollout import position_ids_from

    widths = [(p.tensors["input_ids"].shape[1] - p.tensors["responses"].shape[1], p.tensors["responses"].shape[1])
              for p in parts]
    P, R = max(w[0] for w in widths), max(w[1] for w in widths)
    pad = torch.nn.functional.pad
    cols: dict[str, list[torch.Tensor]] = {}
    offset = 0
    for part, (p, r) in zip(parts, widths):
        t = part.tensors
        for key, value in (("input_ids", pad_id), ("attention_mask", 0)):
            prompt, response = t[key][:, :p], t[key][:, p:]
            cols.setdefault(key, []).append(torch.cat([pad(prompt, (P - p, 0), value=value),
                                                       pad(response, (0, R - r), value=value)], 1))   # (n, P + R)
        for key, value in (("responses", pad_id), ("mask", 0.0), ("old_log_prob", 0.0)):
            if key in t:
                cols.setdefault(key, []).append(pad(t[key], (0, R - r), value=value))                  # (n, R)
        cols.setdefault("scores", []).append(t["scores"])
        cols.setdefault("group_ids", []).append(t["group_ids"] + offset)
        offset += int(t["group_ids"].max()) + 1 if len(t["group_ids"]) else 0
    tensors = {k: torch.cat(v) for k, v in cols.items()}
    tensors["position_ids"] = position_ids_from(tensors["attention_mask"])
    scores, lengths = tensors["scores"], tensors["mask"].sum(1)
    sizes = [len(p) for p in parts]
    metrics = {}
    for key in parts[0].metrics:
        values = [p.metrics[key] for p in parts]
        metrics[key] = max(values) if key.startswith("time_") else sum(v * n for v, n in zip(values, sizes)) / sum(sizes)
    metrics.update(reward_mean=scores.mean().item(), reward_std=scores.std(unbiased=False).item(),
                   reward_max=scores.max().item(), response_length=lengths.mean().item(),
                   gen_tokens_per_s=lengths.sum().item() / max(metrics.get("time_generate", 0.0), 1e-9))
    samples = [s for p in parts for s in p.samples][:log_samples]
    return Batch(tensors=tensors, samples=samples, metrics=metrics, policy_version=parts[0].policy_version)


class LMLearner:
    """The policy's optimizer and the shared PPO update; the policy's files in each checkpoint."""

    def __init__(self, cfg: Config, policy, tokenizer, model_path: Path, parallel: Optional[DataParallel] = None):
        self.cfg, self.policy, self.tokenizer, self.model_path = cfg, policy, tokenizer, model_path
        self.trainer = PPOTrainer(cfg, policy, total_iterations=cfg.iterations, parallel=parallel)
        self.keys = UPDATE_KEYS + (("ref_log_prob",) if cfg.algo.beta > 0 else ())
        self.policy_version = 0

    def needs_scored_old_log_prob(self) -> bool:
        """Whether the scorer must run the actor pass: not when the update makes one
        optimizer step (its own forward gives the old log-probs) and the rewards carry no
        KL term that needs them before the update."""
        return self.cfg.algo.use_kl_in_reward or not self.trainer.fully_on_policy(self.cfg.train.batch_size)

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        t = batch.tensors
        start = time.perf_counter()
        metrics = self.trainer.update({k: t[k] for k in self.keys if k in t}, iteration)
        seconds = time.perf_counter() - start
        metrics["train_tokens_per_s"] = float(t["attention_mask"].sum()) * metrics["epochs"] / max(seconds, 1e-9)
        if "old_log_prob" not in t:      # fully on-policy: the update's own pass gave them
            t["old_log_prob"] = self.trainer.on_policy_log_prob * t["mask"]
        ref = t.get("ref_log_prob", batch.extras.get("ref_log_prob_metric"))      # (N or K, R)
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
        from ppokit.lm.policy_io import save_policy

        save_policy(self.policy, directory, base_model=str(self.model_path), tokenizer=self.tokenizer)

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        from ppokit.lm.policy_io import load_trained_state

        if directory is not None:      # None: the weights come through load_trained_weights
            load_trained_state(self.policy, directory)
        self.trainer.load_state_dict(state["trainer"])
        self.policy_version = int(state.get("policy_version", 0))


class LMEvaluator:
    """Greedy held-out accuracy (mean reward of ``data.reward`` or the task's verifier):
    before training, every ``data.eval_every`` iterations and after training."""

    at_start = True

    def __init__(self, cfg: Config, engine, items: list[dict], reward_fn):
        self.engine, self.items, self.reward_fn = engine, items, reward_fn
        self.every = cfg.data.eval_every
        self.before: Optional[float] = None

    def evaluate(self, phase: str) -> dict[str, float]:
        accuracy = heldout_accuracy(self.engine, self.items, self.reward_fn)
        if phase == "before":
            self.before = accuracy
        key = {"before": "eval_accuracy_before", "final": "eval_accuracy_after"}.get(phase, "eval_accuracy")
        return {key: accuracy}

    def message(self, phase: str, metrics: dict[str, float]) -> Optional[str]:
        if phase == "before":
            return f"held-out accuracy before PPO: {metrics['eval_accuracy_before']:.1%} ({len(self.items)} prompts)"
        if phase == "final":
            before = f" (before: {self.before:.1%})" if self.before is not None else ""
            return f"held-out accuracy after PPO: {metrics['eval_accuracy_after']:.1%}{before}"
        return None

    def stop_reason(self, metrics: dict[str, float]) -> Optional[str]:
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
        from ppokit.lm.hf import causal_lm_config, load_tokenizer

        load_data(self.cfg)
        if self.cfg.model.path != "tiny":
            causal_lm_config(self.cfg.model.path)
            load_tokenizer(self.cfg.model.path)

    def check_checkpoint(self, meta: dict[str, Any], path: Path) -> None:
        from ppokit.lm.policy_io import read_policy_meta

        read_policy_meta(path)          # the policy's files are there (a UserError names what is wrong)

    def shard_plan(self, components: Components, num_shards: int) -> LMShardPlan:
        source = components.source
        return LMShardPlan(source.prompts, num_shards, source.engine.pad_id, self.cfg.run.log_samples)

    def rollout_shard(self, shard: int, num_shards: int) -> LMSource:
        """Generation with the actor alone (lora: the backbone and the actor adapter) and the
        training reward, built as :meth:`build` builds them; the prompts come with each request."""
        from ppokit.lm.hf import load_tokenizer
        from ppokit.lm.policy import build_policy
        from ppokit.lm.rollout import RolloutEngine

        cfg = self.cfg
        device, autocast_dtype = setup(cfg)
        _, _, reward_fn = load_data(cfg)
        reward_model = None
        if cfg.data.reward_model is not None:
            from ppokit.lm.reward_model import RewardModel

            reward_model = RewardModel(cfg.data.reward_model, device=device, autocast_dtype=autocast_dtype,
                                       batch_size=cfg.train.infer_micro_batch_size, cpu_kernels=cfg.model.cpu_kernels)
        train_reward_fn = reward_fn if cfg.data.reward is not None or cfg.data.reward_model is None else None
        small_model_threads(cfg)
        tokenizer = load_tokenizer(self.model_path, "model.path")
        policy = build_policy(cfg, self.model_path, device=device, autocast_dtype=autocast_dtype, seed=cfg.seed,
                              need_critic=False, need_reference=False)
        kv_cache = accelerate(cfg, policy)[1]
        one_thread_if_small(cfg, policy, device)
        engine = RolloutEngine.for_policy(policy, tokenizer, cfg.rollout, kv_cache=kv_cache)
        return LMSource(cfg, engine, None, reward_model, train_reward_fn, device, policy=policy)

    def learner_replica(self, parallel: DataParallel) -> LMLearner:
        """The policy (actor, critic, reference) and its optimizer, built as :meth:`build` builds them."""
        from ppokit.lm.hf import load_tokenizer
        from ppokit.lm.policy import build_policy

        cfg = self.cfg
        device, autocast_dtype = setup(cfg)
        small_model_threads(cfg)
        tokenizer = load_tokenizer(self.model_path, "model.path")
        policy = build_policy(cfg, self.model_path, device=device, autocast_dtype=autocast_dtype, seed=cfg.seed)
        accelerate(cfg, policy)
        one_thread_if_small(cfg, policy, device)
        return LMLearner(cfg, policy, tokenizer, self.model_path, parallel=parallel)

    def build(self, run_dir: Path) -> Components:
        from ppokit import algo
        from ppokit.lm.data import PromptIterator
        from ppokit.lm.hf import causal_lm_config, load_tokenizer
        from ppokit.lm.policy import build_policy
        from ppokit.lm.rollout import RolloutEngine, check_prompts_fit

        cfg, a = self.cfg, self.cfg.algo
        run_dir.mkdir(parents=True, exist_ok=True)
        device, autocast_dtype = setup(cfg)
        train_items, eval_items, reward_fn = load_data(cfg)
        # the training reward: the reward model's score and/or a function's (the task's own only
        # without a reward model; held-out accuracy always uses reward_fn)
        train_reward_fn = reward_fn if cfg.data.reward is not None or cfg.data.reward_model is None else None
        reward_model = None
        if cfg.data.reward_model is not None:     # loaded first: a bad one fails before a warm start runs
            from ppokit.lm.reward_model import RewardModel

            reward_model = RewardModel(cfg.data.reward_model, device=device, autocast_dtype=autocast_dtype,
                                       batch_size=cfg.train.infer_micro_batch_size, cpu_kernels=cfg.model.cpu_kernels)
        model_path = prepare_model(cfg, run_dir, eval_items, reward_fn, _print)
        self.model_path = model_path          # what rollout workers and learner ranks load
        causal_lm_config(model_path, "model.path")            # a clear error before anything heavy
        tokenizer = load_tokenizer(model_path, "model.path")
        policy = build_policy(cfg, model_path, device=device, autocast_dtype=autocast_dtype, seed=cfg.seed)
        accel_note, kv_cache = accelerate(cfg, policy)
        one_thread_if_small(cfg, policy, device)
        engine = RolloutEngine.for_policy(policy, tokenizer, cfg.rollout, kv_cache=kv_cache)
        check_prompts_fit(engine.model, tokenizer, [x["prompt"] for x in train_items + eval_items],
                          cfg.rollout.max_new_tokens)     # every prompt, before the first rollout
        learner = LMLearner(cfg, policy, tokenizer, model_path)
        kl_ctrl = algo.make_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl,
                                          a.kl_ctrl.horizon) if a.use_kl_in_reward else None
        scorer = Scorer(policy, cfg.train.infer_micro_batch_size, need_reference=a.beta > 0,
                        metric_rows=KL_METRIC_ROWS, need_old_log_prob=learner.needs_scored_old_log_prob(),
                        kl_ctrl=kl_ctrl, kl_penalty=a.kl_penalty)
        prompts = PromptIterator(train_items, cfg.train.batch_size // a.group_size, seed=cfg.seed)
        source = LMSource(cfg, engine, prompts, reward_model, train_reward_fn, device, policy=policy)
        evaluator = LMEvaluator(cfg, engine, eval_items, reward_fn) if eval_items else None
        precision = "bf16" if autocast_dtype is not None else "fp32"
        trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        header = [f"lm: {model_path} ({cfg.model.mode}, {trainable:,} trainable parameters), {device}, "
                  f"{precision}{accel_note}, {cfg.iterations} iterations of {cfg.train.batch_size} sequences"]
        return Components(source=source, learner=learner, scorer=scorer, evaluator=evaluator,
                          description=cfg.preset or "lm", header=header)


# ----------------------------------------------------------------------------- building
def setup(cfg: Config) -> tuple[torch.device, Optional[torch.dtype]]:
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


def prepare_model(cfg: Config, run_dir: Path, eval_items: list[dict], reward_fn, log) -> Path:
    """The backbone's directory: model.path, the built-in tiny model, and/or a warm-started copy.

    A complete ``RUN_DIR/base_model`` (its :data:`BASE_MODEL_MARKER` is written last) is
    reused as it is: a resumed run does not warm-start again. An incomplete one (a run
    killed while building it) is deleted and built again, deterministically.
    """
    import shutil

    path = cfg.model.path
    base = run_dir / BASE_MODEL_DIR
    if path == "tiny" or cfg.data.sft_epochs:
        small_model_threads(cfg)        # the built-in model is small (see SMALL_MODEL_PARAMS)
        if (base / BASE_MODEL_MARKER).is_file():
            return base
        for leftover in [base, *run_dir.glob(f".{BASE_MODEL_DIR}.*"), *run_dir.glob(f".{INIT_MODEL_DIR}.*")]:
            if leftover.is_dir():      # a killed build or warm start: start it over
                shutil.rmtree(leftover)
    if path == "tiny":
        from ppokit.lm.tiny import build_tiny_model

        target = run_dir / (INIT_MODEL_DIR if cfg.data.sft_epochs else BASE_MODEL_DIR)
        path = str(build_tiny_model(target, seed=cfg.seed))
    if cfg.data.sft_epochs:
        from ppokit.lm.data import load_prompts
        from ppokit.lm.sft import run_sft

        if not eval_items:
            raise UserError("data.sft_epochs > 0 needs held-out prompts to pick the best warm-start model "
                            "(a built-in task, or data.eval_prompts)")
        examples = load_prompts(cfg.data.prompts, "sft", n=cfg.data.sft_examples, chat=cfg.data.chat_template)
        render = chat_render(cfg)
        if render is not None:
            from ppokit.lm.chat import render_records

            examples = render_records(examples, render)
        run_sft(path, run_dir / BASE_MODEL_DIR, examples, eval_items, epochs_max=cfg.data.sft_epochs,
                batch_size=cfg.data.sft_batch_size, learning_rate=cfg.data.sft_learning_rate, seed=cfg.seed,
                precision=cfg.run.precision, reward_fn=reward_fn, max_new_tokens=cfg.rollout.max_new_tokens,
                device=str(run_device(cfg)), log=log)
        path = str(run_dir / BASE_MODEL_DIR)
    if path == str(base):
        marker = {"model.path": cfg.model.path, "data.sft_epochs": cfg.data.sft_epochs, "seed": cfg.seed}
        (base / BASE_MODEL_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return Path(path)


def sequence_scores(rollout, reward_model, reward_fn, device: torch.device) -> tuple[torch.Tensor, dict]:
    """(N,) float32 sequence rewards: the reward model's score plus the reward function's
    (either may be None); with a reward model, the parts' means as metrics."""
    from ppokit.lm.rewards import score_responses

    parts: dict[str, torch.Tensor] = {}
    if reward_model is not None:
        parts["reward_model_mean"] = torch.tensor(reward_model.score(rollout.prompts, rollout.texts, rollout.items))
    if reward_fn is not None:
        parts["reward_fn_mean"] = torch.tensor(score_responses(reward_fn, rollout.prompts, rollout.texts,
                                                               rollout.items))
    scores = torch.zeros(len(rollout), dtype=torch.float32)
    for part in parts.values():
        scores += part
    metrics = {name: part.mean().item() for name, part in parts.items()} if reward_model is not None else {}
    return scores.to(device), metrics


def rollout_samples(rollout, scores: torch.Tensor, k: int) -> list[dict[str, Any]]:
    """The first ``k`` sequences of a rollout as JSON rows: prompt, response, sequence reward,
    response tokens, truncated, and the prompt's data fields (``answer``, ...). The prompts
    are shuffled, so they are a random sample; with ``group_size`` > 1 they are one group."""
    from ppokit.lm.rewards import reward_fields

    lengths = rollout.response_lengths
    return [{"prompt": rollout.prompts[i], "response": rollout.texts[i], "reward": float(scores[i]),
             "length": int(lengths[i]), "truncated": bool(rollout.truncated[i]),
             "fields": reward_fields(rollout.items[i])} for i in range(min(k, len(rollout)))]


def _print(text: str) -> None:
    """Progress lines before the tracker (and its progress bar) exists."""
    print(text, flush=True)
