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
from ppokit.resume import all_finite
from ppokit.trainer import PPOTrainer

BASE_MODEL_DIR = "base_model"
BASE_MODEL_MARKER = "ppokit_base_model.json"   # in base_model/, written when it is complete
INIT_MODEL_DIR = "init_model"
KL_METRIC_ROWS = 64               # without a KL term, kl_ref is measured on this many sequences
# the batch tensors the update reads (ref_log_prob only with a KL term in the loss)
UPDATE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "mask", "old_log_prob", "old_values",
               "advantages", "returns")


# ----------------------------------------------------------------------------- components
class LMSource:
    """Prompts in, scored responses out: ``collect() -> Batch``."""

    steps_per_iteration = None

    def __init__(self, cfg: Config, engine, prompts, reward_model, reward_fn, device: torch.device):
        self.cfg, self.engine, self.prompts = cfg, engine, prompts
        self.reward_model, self.reward_fn, self.device = reward_model, reward_fn, device

    def collect(self, iteration: int) -> Batch:
        items = self.prompts.next_batch()
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
        return Batch(tensors=tensors, samples=rollout_samples(rollout, scores, self.cfg.run.log_samples),
                     metrics=metrics)

    def sync_weights(self, learner: "LMLearner") -> None:
        """Nothing to do: generation runs the learner's own policy."""

    def state_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        self.prompts.load_state_dict(state["prompts"])
        return []


class LMLearner:
    """The policy's optimizer and the shared PPO update; the policy's files in each checkpoint."""

    def __init__(self, cfg: Config, policy, tokenizer, model_path: Path, *, num_mini_batches: Optional[int] = None,
                 horizon: Optional[int] = None):
        self.cfg, self.policy, self.tokenizer, self.model_path = cfg, policy, tokenizer, model_path
        # multi-turn batches have a varying number of rows: a fixed number of mini-batches instead
        self.num_mini_batches = num_mini_batches
        # Dr.GRPO's constant: the generation budget, whatever the iteration's longest response
        self.trainer = PPOTrainer(cfg, policy, total_iterations=cfg.iterations,
                                  horizon=horizon or cfg.rollout.max_new_tokens)
        self.keys = UPDATE_KEYS + (("ref_log_prob",) if needs_ref_log_prob(cfg) else ())

    def needs_scored_old_log_prob(self) -> bool:
        """Whether the scorer must run the actor pass: not when the update makes one
        optimizer step (its own forward gives the old log-probs) and the rewards carry no
        KL term that needs them before the update."""
        return self.cfg.algo.use_kl_in_reward or not self.trainer.fully_on_policy(self.cfg.train.batch_size,
                                                                                   self.num_mini_batches)

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        t = batch.tensors
        start = time.perf_counter()
        metrics = self.trainer.update({k: t[k] for k in self.keys if k in t}, iteration,
                                      num_mini_batches=self.num_mini_batches)
        seconds = time.perf_counter() - start
        metrics["train_tokens_per_s"] = float(t["attention_mask"].sum()) * metrics["epochs"] / max(seconds, 1e-9)
        if "old_log_prob" not in t:      # fully on-policy: the update's own pass gave them
            t["old_log_prob"] = self.trainer.on_policy_log_prob * t["mask"]
        ref = t.get("ref_log_prob", batch.extras.get("ref_log_prob_metric"))      # (N or K, R)
        if ref is not None:
            metrics["kl_ref"] = kl_ref_metric(t["old_log_prob"], ref, t["mask"])
        return metrics

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """lora: the actor adapter's weights only; full: the actor model's."""
        if self.policy.mode == "lora":
            from peft import get_peft_model_state_dict

            return get_peft_model_state_dict(self.policy.lm, adapter_name="actor")
        return self.policy.lm.state_dict()

    def weights_finite(self) -> bool:
        return all_finite(p for p in self.policy.parameters() if p.requires_grad)

    def state_dict(self) -> dict[str, Any]:
        return {"trainer": self.trainer.state_dict()}

    def save_files(self, directory: Path) -> None:
        from ppokit.lm.policy_io import save_policy

        save_policy(self.policy, directory, base_model=str(self.model_path), tokenizer=self.tokenizer)

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        from ppokit.lm.policy_io import load_trained_state

        load_trained_state(self.policy, directory)
        self.trainer.load_state_dict(state["trainer"])


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
        causal_lm_config(model_path, "model.path")            # a clear error before anything heavy
        tokenizer = load_tokenizer(model_path, "model.path")
        policy = build_policy(cfg, model_path, device=device, autocast_dtype=autocast_dtype, seed=cfg.seed)
        accel_note, kv_cache = "", None
        if cfg.model.cpu_kernels:
            from ppokit.lm.accel import accelerate_policy

            acceleration = accelerate_policy(policy)
            accel_note, kv_cache = acceleration.describe(), acceleration.kv_cache
        one_thread_if_small(cfg, policy, device)
        engine = RolloutEngine.for_policy(policy, tokenizer, cfg.rollout, kv_cache=kv_cache)
        check_prompts_fit(engine.model, tokenizer, [x["prompt"] for x in train_items + eval_items],
                          cfg.rollout.max_new_tokens)     # every prompt, before the first rollout
        learner = LMLearner(cfg, policy, tokenizer, model_path)
        kl_ctrl = algo.make_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl,
                                          a.kl_ctrl.horizon) if a.use_kl_in_reward else None
        scorer = Scorer(policy, cfg.train.infer_micro_batch_size, need_reference=needs_ref_log_prob(cfg),
                        metric_rows=KL_METRIC_ROWS, need_old_log_prob=learner.needs_scored_old_log_prob(),
                        kl_ctrl=kl_ctrl, kl_penalty=a.kl_penalty)
        prompts = PromptIterator(train_items, cfg.train.batch_size // a.group_size, seed=cfg.seed)
        source = LMSource(cfg, engine, prompts, reward_model, train_reward_fn, device)
        evaluator = LMEvaluator(cfg, engine, eval_items, reward_fn) if eval_items else None
        precision = "bf16" if autocast_dtype is not None else "fp32"
        trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        header = [f"lm: {model_path} ({cfg.model.mode}, {trainable:,} trainable parameters), {device}, "
                  f"{precision}{accel_note}, {cfg.iterations} iterations of {cfg.train.batch_size} sequences"]
        return Components(source=source, learner=learner, scorer=scorer, evaluator=evaluator,
                          description=cfg.preset or "lm", header=header)


# ----------------------------------------------------------------------------- building
def needs_ref_log_prob(cfg: Config) -> bool:
    """Whether the update reads the reference's token log-probs: a per-token KL estimator in
    the loss (``full`` computes its KL from the logits during the update)."""
    return cfg.algo.beta > 0 and cfg.algo.kl_loss_type != "full"


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


def prepare_model(cfg: Config, run_dir: Path, eval_items: list[dict], reward_fn, log,
                  sft_examples: Optional[list[dict]] = None) -> Path:
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
        if path == "tiny" and cfg.run.torch_threads is None and run_device(cfg).type == "cpu":
            torch.set_num_threads(1)    # the built-in model is small (see SMALL_MODEL_PARAMS)
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
        examples = sft_examples if sft_examples is not None else load_prompts(
            cfg.data.prompts, "sft", n=cfg.data.sft_examples, chat=cfg.data.chat_template)
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
