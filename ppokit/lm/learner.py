"""The learner of a language-model run, shared by the single- and multi-turn workloads.

:class:`LMLearner` owns the policy's optimizer and runs the shared PPO update
(:class:`ppokit.trainer.PPOTrainer`); it writes the policy's files into each checkpoint
(:mod:`ppokit.lm.model.checkpoint`) and gives the rollout its weights (lora: the actor
adapter only). :func:`make_scorer` builds the scorer that fills a batch before the update
(old and reference log-probs, values, the KL penalty in the rewards).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from peft import get_peft_model_state_dict

from ppokit import algo
from ppokit.components import SEQUENCE_INPUTS, UPDATE_KEYS, Batch
from ppokit.config import Config
from ppokit.lm.model.checkpoint import load_trained_state, save_policy
from ppokit.lm.model.stack import PolicyStack, build_policy_stack
from ppokit.lm.scoring import Scorer, kl_ref_metric
from ppokit.persistence.resume import all_finite, seed_globals
from ppokit.trainer import DataParallel, PPOTrainer

# the batch tensors the update reads (ref_log_prob only with a KL term in the loss; rollout_log_prob,
# the engine's behaviour log-probs, where the engine gave them)
LM_UPDATE_KEYS = (*SEQUENCE_INPUTS, *UPDATE_KEYS, "rollout_log_prob")


def needs_ref_log_prob(cfg: Config) -> bool:
    """Whether the update reads the reference's token log-probs: a per-token KL estimator in
    the loss (``full`` computes its KL from the logits during the update)."""
    return cfg.algo.beta > 0 and cfg.algo.kl_loss_type != "full"


def needs_full_kl_reference(cfg: Config) -> bool:
    """Whether the update runs the reference model itself: the exact KL over the vocabulary in
    the loss (``algo.kl_loss_type=full``). Learner ranks need no reference otherwise: the batch
    brings the reference's token log-probs."""
    return cfg.algo.beta > 0 and cfg.algo.kl_loss_type == "full"


def learner_policy_stack(cfg: Config, model_path: Path, parallel: DataParallel) -> PolicyStack:
    """The policy a learner rank trains, built as the run builds it (seeded): actor and critic, the
    reference only where the loss's exact KL reads it (otherwise the batch brings the
    reference's log-probs). Sharded learners (FSDP) build it in CPU memory: each rank moves its
    shards to its device."""
    seed_globals(cfg.seed)
    return build_policy_stack(
        cfg,
        model_path,
        need_reference=needs_full_kl_reference(cfg),
        in_host_memory=getattr(parallel, "shards", False),
    )


def make_scorer(cfg: Config, policy, learner: LMLearner) -> Scorer:
    """The run's scorer: the reference pass when the loss has a KL term (else on
    :attr:`algo.kl_metric_rows` sequences, for the ``kl_ref`` metric), the actor pass unless the
    update supplies the old log-probs itself, and the KL controller of ``algo.kl_ctrl`` when
    ``algo.use_kl_in_reward`` puts the KL into the rewards."""
    a = cfg.algo
    kl_ctrl = (
        algo.make_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl, a.kl_ctrl.horizon)
        if a.use_kl_in_reward
        else None
    )
    return Scorer(
        policy,
        cfg.infer_micro_batch_size,
        need_reference=needs_ref_log_prob(cfg),
        metric_rows=a.kl_metric_rows,
        need_old_log_prob=learner.needs_scored_old_log_prob(),
        bypass=a.rollout_correction_bypass,
        kl_ctrl=kl_ctrl,
        kl_penalty=a.kl_penalty,
        micro_batch_tokens=cfg.train.micro_batch_tokens,
    )


class LMLearner:
    """The policy's optimizer and the shared PPO update; the policy's files in each checkpoint."""

    reads_shards = False  # a checkpoint's tensors come whole from the run loop

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
        self.keys = LM_UPDATE_KEYS + (("ref_log_prob",) if needs_ref_log_prob(cfg) else ())
        self.policy_version = 0

    def needs_scored_old_log_prob(self) -> bool:
        """Whether the scorer must run the actor pass: not when the update makes one
        optimizer step (its own forward gives the old log-probs) and the rewards carry no
        KL term that needs them before the update, and no rollout correction weighs the tokens
        by them before the update; never in bypass mode (the engine's behaviour log-probs serve)."""
        if self.cfg.algo.rollout_correction_bypass:
            return False
        if self.cfg.algo.rollout_correction != "none" or self.cfg.algo.rollout_correction_rs is not None:
            return True
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
        save_policy(self.policy, directory, base_model=str(self.model_path), tokenizer=self.tokenizer)

    def load_state_dict(self, state: dict[str, Any], directory: Path | None) -> None:
        if directory is not None:  # None: the weights come through load_trained_weights
            load_trained_state(self.policy, directory)
        self.trainer.load_state_dict(state["trainer"])
        self.policy_version = int(state.get("policy_version", 0))
