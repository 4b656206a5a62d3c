"""The PPO update, shared by every workload (:class:`PPOTrainer`).

A batch is a dict of (N, T) tensors with ``mask[n, t] = 1`` where trained (T: response tokens or
environment steps); the update does not know which workload it serves::

    for epoch in range(train.epochs):                            # stop early when approx_kl > target_kl
        for mini_batch in shuffled(batch, mini_batch_size):      # one optimizer step each
            for micro_batch in split(mini_batch):                # rows, or a token budget
                loss = L_policy + value_coeff L_value - entropy_coeff H + beta KL
                loss.backward()                                  # over the mini-batch's normaliser
            clip actor and critic gradients apart; optimizer.step()

``L_policy`` is ``algo.loss_mode`` (:data:`ppokit.algo.POLICY_LOSSES`). ``old_log_prob`` is the first
mini-batch's own forward (no step since the rollout: ratio exactly 1; with one step per update, *fully
on-policy*, the batch may omit it); k steps off, the behaviour policy's; in bypass mode, the engine's.
Micro-batches share the mini-batch's normaliser, so their gradients add up to its gradient; data-parallel
ranks (:mod:`ppokit.cluster.learner_group`) all-reduce the normaliser, gradients and metrics, so the step
is the single learner's. Required keys, metrics and the rest: docs/algorithms.md, "The PPO update".
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from ppokit import algo
from ppokit.components import UPDATE_KEYS
from ppokit.config import Config
from ppokit.errors import UserError
from ppokit.persistence.resume import BadStepGuard

if TYPE_CHECKING:
    from ppokit.components import Batch

REQUIRED_KEYS = UPDATE_KEYS
# normalize_adv whitens the advantages of these estimators over the batch; the others
# (GRPO, Dr.GRPO, RLOO, REINFORCE++) define their own normalisation or baseline, and a
# second whitening would give a group whose samples all got one reward a non-zero advantage
WHITENED_ESTIMATORS = ("gae",)
OPTIONAL_WHEN_ON_POLICY = ("old_log_prob",)  # see "fully on-policy" in the module docstring


# per-step metrics that are maxima (over micro-batches and data-parallel ranks), not weighted sums
MAX_METRICS = ("ratio_max", "old_log_prob_gap")


class DataParallel(Protocol):
    """How the update shares a mini-batch with other learners (:mod:`ppokit.cluster.parallel`,
    :mod:`ppokit.cluster.fsdp`)."""

    world_size: int

    def prepare(self, policy: TrainablePolicy) -> None:
        """Make ``policy`` ready before the optimizer sees its parameters (FSDP: shard it)."""

    def passes(self, count: int) -> int:
        """The forward/backward passes of a mini-batch every rank makes when this rank has ``count``
        micro-batches (FSDP, whose collectives run in each pass: the most any rank has)."""

    def shard(self, index: Tensor) -> Tensor:
        """This rank's contiguous part of a mini-batch's sample indices."""

    def all_reduce(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """``tensor`` summed (``op="max"``: the maximum) over the ranks, in place; returned."""

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks (a missing gradient counts as zeros)."""


class SingleProcess:
    """One learner: nothing to share."""

    world_size = 1

    def prepare(self, policy: TrainablePolicy) -> None:
        pass

    def passes(self, count: int) -> int:
        return count

    def shard(self, index: Tensor) -> Tensor:
        return index

    def all_reduce(self, tensor: Tensor, op: str = "sum") -> Tensor:
        return tensor

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        pass


class TrainablePolicy(Protocol):
    """What the update loop needs from a model (a ``torch.nn.Module`` in practice); the
    attributes and :meth:`refresh_parameters` are what FSDP sharding needs (:mod:`ppokit.cluster.fsdp`)."""

    autocast_dtype: torch.dtype | None  # the compute precision (bf16: FSDP's parameter dtype), None: float32
    compute_device: torch.device | None  # where the passes run when not the weights' device (FSDP offload)

    def refresh_parameters(self) -> None:
        """Re-read any cached parameter lists (after FSDP replaced the parameters with shards)."""

    def param_groups(self, cfg: Config) -> list[dict[str, Any]]:
        """Optimizer parameter groups, each with ``params``, ``lr`` and ``name``."""

    def evaluate(self, micro_batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``log_prob``, ``values`` (none without a critic) and ``entropy``, each (n, T), under the
        current parameters."""

    def compact(self, micro_batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``micro_batch`` without its padding columns (every (n, T) tensor cut to (n, T'), T' <= T,
        only positions with mask 0 removed), for ``train.micro_batch_tokens``, whose micro-batches
        are formed to be cut (:meth:`ppokit.lm.model.policy.LMPolicy.compact`)."""


@dataclass(frozen=True)
class StepPlan:
    """What every optimizer step of one update shares."""

    micro: int  # rows per micro-batch (train.micro_batch_tokens: at most this many)
    horizon: int  # seq-mean-token-sum-norm's constant (the batch's width where not set)
    critic_only: bool  # the critic's warm-up: no actor terms
    penalty_coef: float | None  # PPO-penalty's coefficient for this iteration


def compute_advantages(
    cfg: Config,
    *,
    rewards: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    dones: Tensor | None = None,
    last_values: Tensor | None = None,
    group_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns, (B, T) each, with the configured estimator.

    With ``algo.normalize_adv`` the advantages of :data:`WHITENED_ESTIMATORS` (GAE) are
    whitened over the valid positions of the whole batch; the group estimators and
    REINFORCE++ keep the normalisation they define (as verl does).
    """
    a = cfg.algo
    estimator = algo.get_advantage_estimator(a.adv_estimator)
    advantages, returns = estimator(
        rewards=rewards,
        mask=mask,
        values=values,
        group_ids=group_ids,
        gamma=a.gamma,
        lam=a.gae_lambda,
        dones=dones,
        last_values=last_values,
        norm_by_std=a.scale_rewards != "none",
        batch_std=a.scale_rewards == "batch",
    )
    if a.normalize_adv and a.adv_estimator in WHITENED_ESTIMATORS:
        advantages = algo.whiten(advantages, mask)
    return advantages, returns


def batch_advantages(cfg: Config, batch: Batch) -> tuple[Tensor, Tensor]:
    """:func:`compute_advantages` of a :class:`~ppokit.components.Batch` from its rollout:
    ``rewards``, ``mask``, ``old_values`` (GAE only), ``dones`` and ``extras["last_values"]``
    (control), ``group_ids`` (lm group estimators). The run loop's default; a workload whose
    batches need another rule gives its own (:attr:`ppokit.components.Components.advantages`)."""
    t = batch.tensors
    return compute_advantages(
        cfg,
        rewards=t["rewards"],
        mask=t["mask"],
        values=t.get("old_values") if cfg.algo.adv_estimator == "gae" else None,
        dones=t.get("dones"),
        last_values=batch.extras.get("last_values"),
        group_ids=t.get("group_ids"),
    )


def lr_lambda(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The learning-rate multiplier after ``step`` optimizer steps (for ``LambdaLR``).

    Linear warm-up from 1/warmup to 1 over ``warmup_steps``, then ``constant`` (1),
    ``linear`` (to 0 at ``total_steps``) or ``cosine`` (half cosine to 0).
    """
    total_steps = max(total_steps, 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if kind == "linear":
            return 1.0 - progress
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


def make_optimizer(groups: list[dict[str, Any]], cfg: Config) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over the policy's parameter groups, with PyTorch's fused kernel
    (one pass per parameter; on a CPU about 10% faster than ``foreach`` for small networks,
    docs/performance.md) where it supports the parameters, else ``foreach``."""
    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(
        p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params
    )
    return torch.optim.AdamW(
        groups,
        eps=cfg.train.adam_eps,
        weight_decay=cfg.train.weight_decay,
        **({"fused": True} if fused else {"foreach": True}),
    )


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (the L2 norm of all of ``params``' gradients, which are
    scaled by ``max_norm / norm`` when above it), for gradients that are FSDP shards too: the
    norm of sharded gradients is reduced over the ranks (``full_tensor``) before the scaling,
    so every rank clips with the whole gradient's norm. Returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    if hasattr(total, "full_tensor"):  # a DTensor: the sum of the ranks' partial squared norms
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total.detach()


class PPOTrainer:
    """Owns the optimizer and schedule; :meth:`update` runs one iteration's epochs."""

    def __init__(
        self,
        cfg: Config,
        policy: TrainablePolicy,
        *,
        total_iterations: int,
        updates_per_iteration: int | None = None,
        horizon: int | None = None,
        parallel: DataParallel | None = None,
    ):
        """``horizon``: the constant of ``seq-mean-token-sum-norm`` (Dr.GRPO), e.g. a language
        model's generation budget; None uses each batch's length. ``parallel``: the other
        learners of a data-parallel group (default: none)."""
        self.cfg = cfg
        self.policy = policy
        self.horizon = horizon
        self.parallel: DataParallel = parallel or SingleProcess()
        self.parallel.prepare(policy)  # FSDP: the policy sharded before the optimizer takes its parameters
        # the rollout ran up to k updates behind: its log-probs are the behaviour policy's (module docstring)
        self.off_policy = cfg.rollout.off_policy_steps > 0
        # bypass mode: old_log_prob are the engine's behaviour log-probs (module docstring)
        self.bypass = cfg.algo.rollout_correction_bypass
        self.rejection_rules = cfg.algo.rejection_rules  # parsed once: bypass tests them in every pass
        groups = [g for g in policy.param_groups(cfg) if g["params"]]
        self.params = [p for g in groups for p in g["params"]]
        # gradient-norm clipping per group: the actor's at train.grad_clip, the critic's
        # (value head included) at train.critic_grad_clip
        t = cfg.train
        critic_clip = t.critic_grad_clip if t.critic_grad_clip is not None else t.grad_clip
        self.clip_groups = [
            (g.get("name", f"group{i}"), g["params"], critic_clip if g.get("name") == "critic" else t.grad_clip)
            for i, g in enumerate(groups)
        ]
        self.optimizer = make_optimizer(groups, cfg)
        a = cfg.algo
        self.policy_loss = algo.get_policy_loss(a.loss_mode)
        self.penalty = (
            algo.AdaptivePenaltyCoef(a.penalty_coef, a.penalty_target_kl) if a.loss_mode == "penalty" else None
        )
        if updates_per_iteration is None:
            updates_per_iteration = cfg.train.epochs * (cfg.train.batch_size // cfg.mini_batch_size)
        total = total_iterations * updates_per_iteration
        warmup = int(cfg.train.lr_warmup_ratio * total)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.train.lr_scheduler_type, warmup, total)
        )
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.skipped_steps = 0  # all skipped steps of the run
        # after train.max_bad_steps skipped steps in a row: TrainingDiverged (the run loop says where
        # the last good checkpoint is)
        self.bad_steps = BadStepGuard(cfg.train.max_bad_steps)
        # (N, T) float32: the last update's log-probs of its first mini-batch's rows, from
        # the policy that sampled them (0 on the other rows); None before the first update
        self.on_policy_log_prob: Tensor | None = None
        self._positions_real: Tensor | int = 0  # real and computed token positions of this update
        self._positions_computed = 0

    def fully_on_policy(self, n: int, num_mini_batches: int | None = None) -> bool:
        """Whether an update of ``n`` samples makes one optimizer step (one epoch of one
        mini-batch) on data sampled by the current weights, so that all of it is on-policy."""
        if self.off_policy or self.cfg.train.epochs != 1:
            return False
        if num_mini_batches is not None:
            return num_mini_batches == 1
        return self.cfg.mini_batch_size >= n

    # ------------------------------------------------------------------------ update
    def update(
        self, batch: dict[str, Tensor], iteration: int = 0, num_mini_batches: int | None = None
    ) -> dict[str, float]:
        """Epochs over shuffled mini-batches; returns the iteration's mean metrics.

        ``num_mini_batches``: split each epoch into this many mini-batches of near-equal
        size, whatever the number of rows (multi-turn batches, whose rows per iteration
        vary); default: mini-batches of ``train.mini_batch_size`` rows."""
        n = batch["mask"].shape[0] if "mask" in batch else 0
        batch = self._bypass_old_log_prob(batch)
        for key in REQUIRED_KEYS:
            on_policy = self.fully_on_policy(n, num_mini_batches)
            if key not in batch and not (key in OPTIONAL_WHEN_ON_POLICY and on_policy):
                raise KeyError(
                    f"batch is missing '{key}' (needs {', '.join(REQUIRED_KEYS)}; "
                    f"{', '.join(OPTIONAL_WHEN_ON_POLICY)} only when the update is not fully on-policy)"
                )
        cfg, a = self.cfg, self.cfg.algo
        batch, correction_metrics = self._rollout_correction(batch)
        mini = min(self.cfg.mini_batch_size, n) if num_mini_batches is None else max(1, -(-n // num_mini_batches))
        plan = self._step_plan(batch, iteration, micro=min(self.cfg.micro_batch_size, mini))
        sums: dict[str, Tensor] = {}
        weights: dict[str, float] = {}
        epochs_done = 0
        skipped_before = self.skipped_steps
        self._positions_real = self._positions_computed = 0
        self.on_policy_log_prob = torch.zeros(batch["mask"].shape, dtype=torch.float32, device=batch["mask"].device)
        first_rows = torch.zeros(n, dtype=torch.float32, device=batch["mask"].device)  # (N,) 1: in on_policy_log_prob
        for epoch in range(cfg.train.epochs):
            epoch_kl = []
            order = torch.randperm(n, generator=self.generator)
            for step, mb_index in enumerate(order.split(mini)):
                mb_index = self.parallel.shard(mb_index)  # this learner's part of the mini-batch
                mb = {k: v[mb_index] for k, v in batch.items()}
                step_metrics, current = self._optimizer_step(mb, plan, on_policy=epoch == 0 and step == 0)
                for rows, log_prob in current:  # (n, T') each: back into the (N, T) layout
                    self.on_policy_log_prob[mb_index[rows], : log_prob.shape[1]] = log_prob.float()
                    first_rows[mb_index[rows]] = 1.0
                for k, v in step_metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                    weights[k] = weights.get(k, 0.0) + 1.0
                if "approx_kl" in step_metrics:
                    epoch_kl.append(step_metrics["approx_kl"])
            epochs_done += 1
            if a.target_kl is not None and epoch_kl and torch.stack(epoch_kl).mean().item() > a.target_kl:
                break
        self.parallel.all_reduce(self.on_policy_log_prob)  # each rank filled its own rows
        if self.parallel.world_size > 1:  # the positions of every rank's passes
            positions = torch.tensor([float(self._positions_real), float(self._positions_computed)])
            self.parallel.all_reduce(positions.to(self.on_policy_log_prob.device))
            self._positions_real, self._positions_computed = positions[0].item(), positions[1].item()
        if "rollout_log_prob" in batch and "old_log_prob" not in batch:  # fully on-policy: its own forward
            correction_metrics = algo.mismatch_metrics(
                self.on_policy_log_prob, batch["rollout_log_prob"], batch["mask"]
            )
        elif self.bypass:  # the engine against the trainer on the rows of the first mini-batch (its own forward)
            if self.parallel.world_size > 1:
                self.parallel.all_reduce(first_rows)
            correction_metrics = algo.mismatch_metrics(
                self.on_policy_log_prob, batch["rollout_log_prob"], batch["mask"] * first_rows[:, None]
            )
        out = {k: (torch.as_tensor(sums[k]) / weights[k]).item() for k in sums}
        out.update({k: float(v) for k, v in correction_metrics.items()})
        if self.penalty is not None and epoch_kl:
            # the PPO paper's d: the KL after the update, measured on the last epoch's mini-batches
            out["penalty_coef"] = plan.penalty_coef
            self.penalty.update(torch.stack(epoch_kl).mean().item())
        out["epochs"] = float(epochs_done)
        if self._positions_computed and "attention_mask" in batch:  # token sequences: padding share computed
            out["padding_frac"] = 1.0 - float(self._positions_real) / self._positions_computed
        out["skipped_steps"] = float(self.skipped_steps - skipped_before)  # in this iteration
        out.update(self._learning_rates())
        if "value_loss" in out:  # the critic's fit (a policy without one has no values)
            with torch.no_grad():
                out["explained_variance"] = algo.explained_variance(
                    batch["old_values"], batch["returns"], batch["mask"]
                ).item()
        return out

    def _learning_rates(self) -> dict[str, float]:
        """``lr``, and with several parameter groups ``lr/<group>`` each (``lr``: the first's)."""
        groups = self.optimizer.param_groups
        if len(groups) == 1:
            return {"lr": groups[0]["lr"]}
        return {**{f"lr/{g.get('name', 'group')}": g["lr"] for g in groups}, "lr": groups[0]["lr"]}

    def _bypass_old_log_prob(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Bypass mode: the batch with ``old_log_prob`` = its ``rollout_log_prob`` (the engine's
        behaviour log-probs, 0 on the tokens the model did not sample); else the batch as it is."""
        if not self.bypass:
            return batch
        if "rollout_log_prob" not in batch:
            raise ValueError(
                "algo.rollout_correction_bypass needs the batch's rollout_log_prob (the engine's behaviour "
                "log-probs; greedy generation gives none): set algo.rollout_correction_bypass=false"
            )
        return {**batch, "old_log_prob": batch["rollout_log_prob"]}

    def _rollout_correction(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The batch with ``correction_weight`` and ``correction_keep`` (N, T) added when
        ``algo.rollout_correction`` asks for them, and the mismatch and correction metrics
        (:mod:`ppokit.algo.rollout_correction`); the batch as it is without ``rollout_log_prob``.
        The weights and kept tokens of ``pi_old / pi_engine`` are computed once per batch and
        applied to every actor term; in bypass mode the rejection rules run in each pass instead."""
        a = self.cfg.algo
        if self.bypass:  # pi_old = pi_engine: no weight; the rules run in each pass (_accumulate_gradients)
            return batch, {}
        rules = self.rejection_rules
        if "rollout_log_prob" not in batch or "old_log_prob" not in batch:
            if a.rollout_correction != "none" or rules:
                missing = "rollout_log_prob" if "rollout_log_prob" not in batch else "old_log_prob"
                what = f"algo.rollout_correction={a.rollout_correction}" if not rules else "algo.rollout_correction_rs"
                raise ValueError(
                    f"{what} needs the batch's {missing} (the engine's behaviour log-probs and the scorer's "
                    "old log-probs)"
                )
            return batch, {}
        metrics = algo.mismatch_metrics(batch["old_log_prob"], batch["rollout_log_prob"], batch["mask"])
        if a.rollout_correction == "none" and not rules:
            return batch, metrics
        weight, keep, more = algo.rollout_correction(
            batch["old_log_prob"],
            batch["rollout_log_prob"],
            batch["mask"],
            mode=a.rollout_correction,
            level=a.rollout_correction_level,
            cap=a.rollout_correction_cap,
            lower=a.rollout_correction_lower,
            rejection=rules,
        )
        return {**batch, "correction_weight": weight, "correction_keep": keep}, {**metrics, **more}

    def _step_plan(self, batch: dict[str, Tensor], iteration: int, micro: int) -> StepPlan:
        """The steps' shared settings for an update of ``batch`` at ``iteration``."""
        return StepPlan(
            micro=micro,
            horizon=self.horizon or batch["mask"].shape[1],
            critic_only=iteration < self.cfg.train.critic_warmup,
            penalty_coef=self.penalty.value if self.penalty is not None else None,  # this iteration's
        )

    def _optimizer_step(
        self, mb: dict[str, Tensor], plan: StepPlan, on_policy: bool = False
    ) -> tuple[dict[str, Tensor], list[tuple[slice | Tensor, Tensor]]]:
        """One optimizer step over mini-batch ``mb`` (this rank's part of it): its metrics, and
        with ``on_policy`` each micro-batch's rows of ``mb`` and its detached log-probs (n, T')."""
        totals, current = self._accumulate_gradients(mb, plan, on_policy)
        totals.update(self._clip_and_step())
        return totals, current

    def mini_batch_gradients(self, batch: dict[str, Tensor], iteration: int = 0) -> dict[str, Tensor]:
        """The gradient of the first optimizer step of an update of ``batch`` (its first
        mini-batch under the trainer's shuffle), summed over the data-parallel ranks, by
        parameter name; no step is taken and the shuffle generator is left as it was."""
        batch, _ = self._rollout_correction(self._bypass_old_log_prob(batch))
        n = batch["mask"].shape[0]
        state = self.generator.get_state()
        order = torch.randperm(n, generator=self.generator)
        self.generator.set_state(state)
        mb_index = self.parallel.shard(order[: min(self.cfg.mini_batch_size, n)])
        mb = {k: v[mb_index] for k, v in batch.items()}
        plan = self._step_plan(batch, iteration, micro=min(self.cfg.micro_batch_size, self.cfg.mini_batch_size))
        self._accumulate_gradients(mb, plan, on_policy=True)
        names = {id(p): name for name, p in self.policy.named_parameters()}
        grads = {
            names[id(p)]: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for p in self.params
        }
        self.optimizer.zero_grad()
        return grads

    def _global_normalizer(self, mask: Tensor, mode: str) -> Tensor:
        """:func:`algo.aggregation_normalizer` of the whole mini-batch that the ranks' parts make
        up: its token count (token-mean) or sequence count (the seq-mean modes)."""
        if self.parallel.world_size == 1:
            return algo.aggregation_normalizer(mask, mode)
        count = (mask != 0).sum() if mode == "token-mean" else torch.tensor(mask.shape[0], device=mask.device)
        return self.parallel.all_reduce(count.to(torch.int64)).clamp(min=1)

    def _accumulate_gradients(
        self, mb: dict[str, Tensor], plan: StepPlan, on_policy: bool
    ) -> tuple[dict[str, Tensor], list[tuple[slice | Tensor, Tensor]]]:
        """Zero the gradients, backward every micro-batch of ``mb`` with the whole mini-batch's
        normaliser, sum the gradients over the ranks; the step's metrics (reduced over the ranks)
        and, ``on_policy``, each micro-batch's rows and detached log-probs (n, T')."""
        mode = self.cfg.algo.loss_agg_mode
        normalizer = self._global_normalizer(mb["mask"], mode)
        # rollout correction (mis): the actor's terms skip the dropped tokens, normalised without them
        keep_all = mb.get("correction_keep")
        actor_normalizer = normalizer if keep_all is None else self._global_normalizer(mb["mask"] * keep_all, mode)
        self.optimizer.zero_grad()
        totals: dict[str, Tensor] = {}
        current_rows: list[tuple[slice | Tensor, Tensor]] = []
        micro_batches = list(algo.micro_batch_indices(mb, plan.micro, self.cfg.train.micro_batch_tokens))
        # FSDP ranks run their collectives in every pass: a rank with fewer micro-batches repeats its
        # last one with its loss times 0 (no gradient, no metrics) until every rank has made as many
        passes = self.parallel.passes(len(micro_batches))
        if passes and not micro_batches:
            raise UserError(
                f"a mini-batch of this update leaves one of the {self.parallel.world_size} learners no sample; "
                "lower cluster.learners or raise train.mini_batch_size"
            )
        for index in range(passes):
            idle = index >= len(micro_batches)
            rows = micro_batches[min(index, len(micro_batches) - 1)]
            part = self._micro_part(mb, rows, counted=not idle)
            out = self.policy.evaluate(part)
            # before the first step: the sampling policy's log-probs (off-policy: one update newer)
            current = out["log_prob"].detach() if on_policy else None
            if current is not None and not idle:
                current_rows.append((rows, current))
            loss, losses, metrics = self._critic_terms(out, part, plan, normalizer)
            if not plan.critic_only:
                loss, actor_losses, actor_metrics = self._add_actor_terms(
                    loss, out, part, plan, actor_normalizer, current, idle
                )
                losses.update(actor_losses)
                metrics.update(actor_metrics)
            # idle: the same backward graph as a real pass, a zero gradient
            (loss * 0.0 if idle else loss).backward()
            # this pass's outputs, kept until the next pass's forward, hold memory of their graph
            # through it: SmolLM2's fp32 update peaked at 9.7 GB with them, 6.4 GB without
            del out, loss
            if idle:
                continue
            # Losses computed with the mini-batch normalizer add up over micro-batches;
            # rates (clipfrac, approx_kl) are means over this micro-batch: weight by its share.
            share = algo.aggregation_normalizer(part["mask"], mode) / normalizer
            for k, v in losses.items():
                totals[k] = totals.get(k, 0.0) + v
            for k, v in metrics.items():
                if k in MAX_METRICS:
                    totals[k] = torch.maximum(totals[k], v) if k in totals else v
                else:
                    totals[k] = totals.get(k, 0.0) + v * share
        if self.parallel.world_size > 1:
            self.parallel.all_reduce_grads(self.params)
            totals = self._reduce_metrics(totals)
        return totals, current_rows

    def _micro_part(self, mb: dict[str, Tensor], rows: slice | Tensor, counted: bool) -> dict[str, Tensor]:
        """The micro-batch ``rows`` of ``mb`` (train.micro_batch_tokens: without its padding
        columns); ``counted``: its real and computed positions go to the padding metric."""
        part = {k: v[rows] for k, v in mb.items()}
        if self.cfg.train.micro_batch_tokens is not None:
            part = self.policy.compact(part)  # (n, T') tensors: this micro-batch's padding columns dropped
        if counted:
            width = part["attention_mask"] if "attention_mask" in part else part["mask"]
            self._positions_real = self._positions_real + width.sum()  # no host sync here
            self._positions_computed += width.numel()
        return part

    def _critic_terms(
        self, out: dict[str, Tensor], part: dict[str, Tensor], plan: StepPlan, normalizer: Tensor
    ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """The pass's loss so far (the value term; 0 for a policy without a critic), its losses and metrics."""
        a = self.cfg.algo
        loss = out["log_prob"].new_zeros(())
        losses: dict[str, Tensor] = {}
        metrics: dict[str, Tensor] = {}
        if "values" in out:  # a policy without a critic (critic-free estimators) has none
            v_loss, v_metrics = algo.value_loss(
                out["values"],
                part["old_values"],
                part["returns"],
                part["mask"],
                clip_value=a.clip_value,
                huber_delta=a.huber_delta,
                agg_mode=a.loss_agg_mode,
                normalizer=normalizer,
                horizon=plan.horizon,
                diagnostics=False,
            )
            loss = loss + a.value_coeff * v_loss
            losses["value_loss"] = v_loss.detach()
            metrics["vf_clipfrac"] = v_metrics["vf_clipfrac"]
        return loss, losses, metrics

    def _add_actor_terms(
        self,
        loss: Tensor,
        out: dict[str, Tensor],
        part: dict[str, Tensor],
        plan: StepPlan,
        normalizer: Tensor,
        current: Tensor | None,
        idle: bool,
    ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """``loss`` + the policy loss - entropy_coeff x entropy + beta x KL (added in this order), the
        terms' values and the policy loss's metrics. ``current``: the pass's detached log-probs on
        the update's first step (None after it)."""
        a, mode, mask = self.cfg.algo, self.cfg.algo.loss_agg_mode, part["mask"]
        losses: dict[str, Tensor] = {}
        metrics: dict[str, Tensor] = {}
        actor_mask = mask if "correction_keep" not in part else mask * part["correction_keep"]
        advantages = part["advantages"]
        if "correction_weight" in part:  # the importance weights pi_old / pi_engine, truncated (tis) or not
            advantages = advantages * part["correction_weight"]
        old_log_prob = part.get("old_log_prob")
        if self.bypass and a.rollout_correction_rs is not None:
            # bypass: the rules test the current policy against the engine (old_log_prob), in
            # each pass; the normaliser keeps the rejected tokens (verl's bypass mode)
            rs_keep, rs_metrics = algo.rollout_rejection(
                out["log_prob"].detach(), old_log_prob, mask, self.rejection_rules
            )
            actor_mask = actor_mask * rs_keep
            dropped = (rs_keep == 0) & (mask != 0)  # (n, T)
            metrics.update({k: v for k, v in rs_metrics.items() if not k.endswith("_max")})  # means only
            metrics["correction_masked_frac"] = algo.masked_mean(dropped.float(), mask)
            metrics["correction_seq_masked_frac"] = algo.masked_mean(dropped.any(-1).float(), mask.any(-1))
        if current is not None:
            if old_log_prob is not None and not idle:  # a maximum over the step's passes (MAX_METRICS)
                metrics["old_log_prob_gap"] = (current - old_log_prob).abs().masked_fill(mask == 0, 0.0).amax()
            if self.off_policy:  # the behaviour policy's log-probs stay old_log_prob
                lag = algo.kl_penalty(old_log_prob, current, "k3")  # KL(behaviour || current)
                metrics["off_policy_kl"] = algo.aggregate(lag, mask, "token-mean")
            elif not self.bypass:  # the policy that sampled this data: the ratio is exactly 1
                old_log_prob = current
        pg_loss, pg_metrics = self.policy_loss(
            algo.PolicyLossInputs(
                out["log_prob"],
                old_log_prob,
                advantages,
                actor_mask,
                agg_mode=mode,
                normalizer=normalizer,
                horizon=plan.horizon,
                penalty_coef=plan.penalty_coef,
            ),
            a,
        )
        loss = loss + pg_loss
        losses["policy_loss"] = pg_loss.detach()
        # every metric the loss returns (clipfrac, ratio_max, kl_old, gate_mean, ...); k3 is approx_kl
        metrics.update((k, v) for k, v in pg_metrics.items() if k != "approx_kl_k3")
        metrics["approx_kl"] = pg_metrics["approx_kl_k3"]
        if "entropy" in out:
            entropy = algo.aggregate(out["entropy"], actor_mask, mode, normalizer=normalizer, horizon=plan.horizon)
            if a.entropy_coeff:
                loss = loss - a.entropy_coeff * entropy
            losses["entropy"] = entropy.detach()
        if a.beta > 0:
            # "full": the exact KL over the vocabulary, which the policy computes from its logits
            kl = (
                out["kl_full"]
                if a.kl_loss_type == "full"
                else algo.kl_penalty(out["log_prob"], part["ref_log_prob"], a.kl_loss_type)
            )
            kl_loss = algo.aggregate(kl, actor_mask, mode, normalizer=normalizer, horizon=plan.horizon)
            loss = loss + a.beta * kl_loss
            losses["kl_loss"] = kl_loss.detach()
        return loss, losses, metrics

    def _reduce_metrics(self, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        """Step metrics over the ranks: sums (losses use the global normaliser, rates are
        weighted by each micro-batch's share of it), maxima for :data:`MAX_METRICS`."""
        keys = sorted(totals)  # the same keys on every rank (config: each rank has samples)
        out = {}
        for op in ("sum", "max"):
            names = [k for k in keys if (k in MAX_METRICS) == (op == "max")]
            if names:
                packed = torch.stack([torch.as_tensor(totals[k], dtype=torch.float32).reshape(()) for k in names])
                self.parallel.all_reduce(packed, op)
                out.update(zip(names, packed))
        return out

    def _clip_and_step(self) -> dict[str, Tensor]:
        """Clip each group's gradient norm at its own limit, step; ``grad_norm/<group>`` before clipping."""
        norms = {}
        for name, params, clip in self.clip_groups:
            if any(p.grad is not None for p in params):  # (critic_warmup: the actor has none)
                max_norm = clip if clip is not None else float("inf")
                norms[f"grad_norm/{name}"] = clip_grad_norm(params, max_norm)
        ok = all(bool(torch.isfinite(n)) for n in norms.values())
        if not ok:
            # A non-finite gradient would poison Adam's moments: skip this step.
            self.optimizer.zero_grad()
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()" when a first step is skipped
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()  # the schedule advances even when a step is skipped
        self.bad_steps.step(ok)  # raises TrainingDiverged after max_bad_steps bad steps in a row
        return norms

    # -------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "skipped_steps": self.skipped_steps,
            "bad_steps": self.bad_steps.state_dict(),
        }
        if self.penalty is not None:
            state["penalty"] = self.penalty.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.penalty is not None:
            self.penalty.load_state_dict(state["penalty"])
        self.bad_steps.load_state_dict(state.get("bad_steps", {}))
