"""Typed, validated configuration.

A run's configuration is built from layers, later ones winning key by key:

1. the built-in defaults of each field (UnstableBaselines' PPO hyperparameters, a
   language-model setting), then the workload's own defaults (:data:`WORKLOAD_DEFAULTS`: what a
   Gymnasium task needs instead, e.g. ``learning_rate=3e-4``);
2. a preset (``ppokit/presets/NAME.yaml``) or a user YAML file;
3. dotted command-line overrides: ``ppokit train cartpole algo.gamma=0.98 seed=3``.

Every layer is first rewritten to canonical names: the names of other frameworks (verl,
RLinf, CleanRL, SB3) are accepted as aliases where they mean the same thing, e.g.
``lam`` -> ``gae_lambda``, ``clip_ratio_low`` -> ``lower_clip_ratio``, ``ppo_epochs`` ->
``epochs``; ``clip_ratio`` sets both clip bounds. Then pydantic validates types and
ranges, and :meth:`Config._check_combinations` the combinations. Every problem becomes
a :class:`~ppokit.errors.ConfigError` with the field's dotted path, the allowed values
and, for unknown keys, a "did you mean" suggestion.

This module imports neither torch nor gymnasium: ``ppokit config`` stays fast.
"""

from __future__ import annotations

import copy
import math
import os
import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ppokit.errors import ConfigError, UserError, did_you_mean

PRESET_DIR = Path(__file__).with_name("presets")

# Names of the registries in ppokit.algo, as literal types so that the config needs no
# torch import. tests/test_config.py checks that they match the registries.
AdvEstimatorName = Literal["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gigpo"]
AggModeName = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimatorName = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"]
PolicyLossName = Literal[
    "clip",
    "ppo",
    "vanilla",
    "penalty",
    "ppo_penalty",
    "cispo",
    "dppo_tv",
    "dppo_kl",
    "gpg",
    "dro",
    "sapo",
    "geo_mean",
    "gmpo",
    "clip_cov",
    "kl_cov",
]
POLICY_LOSS_ALIASES = {"ppo": "clip", "vanilla": "clip", "ppo_penalty": "penalty", "gmpo": "geo_mean"}
TOKEN_RATIO_LOSSES = ("cispo", "dppo_tv", "dppo_kl", "gpg", "dro", "sapo", "geo_mean", "clip_cov", "kl_cov")
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline", "gigpo")
# Seeds go to torch.manual_seed (at most 2**64 - 1) and, plus offsets, to Gymnasium (>= 0).
SEED_MAX = 2**63 - 1

# Names that mean the same thing in other frameworks, with the estimator names they use.
_VALUE_ALIASES = {
    "adv_estimator": {"reinforce_plus_plus": "reinforce_pp", "reinforce_plus_plus_baseline": "reinforce_pp_baseline"},
    "metric": {"acc": "verifier", "score": "verifier", "seq_reward": "reward"},  # rollout.dynamic_sampling
}


PositiveInt = Annotated[int, Field(ge=1)]


def field(default: Any, description: str, *aliases: str, **constraints: Any) -> Any:
    """A config field: default, one-line description, accepted aliases, constraints."""
    extra = {"aliases": list(aliases)} if aliases else None
    return Field(default, description=description, json_schema_extra=extra, **constraints)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignment re-validates,
    numbers are finite and true/false is not a number."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, bool) for v in items) and _takes_numbers(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got {str(value).lower()}")
        return value


def _takes_numbers(annotation: Any) -> bool:
    """``int``, ``Optional[float]``, ``list[int]``, ...: does a field of this type hold numbers?"""
    return annotation in (int, float) or any(_takes_numbers(arg) for arg in get_args(annotation))


class KLControlConfig(Section):
    """Coefficient of the KL penalty put into the reward (``algo.use_kl_in_reward``)."""

    type: Literal["fixed", "adaptive"] = field("fixed", "fixed coefficient, or the InstructGPT adaptive rule")
    kl_coef: float = field(0.001, "the (initial) coefficient of the in-reward KL penalty", "init_kl_coef", ge=0)
    target_kl: float = field(6.0, "adaptive: the KL the controller steers towards", gt=0)
    horizon: int = field(10000, "adaptive: steps over which the coefficient may change by up to 20%", gt=0)

    @model_validator(mode="after")
    def _adaptive_needs_a_start(self) -> KLControlConfig:
        if self.type == "adaptive" and self.kl_coef <= 0:
            raise ValueError("kl_ctrl.type=adaptive multiplies the coefficient, so kl_ctrl.kl_coef must be > 0")
        return self


class AlgoConfig(Section):
    """The PPO objective and the advantage estimator (pure math, see ppokit.algo)."""

    adv_estimator: AdvEstimatorName = field("gae", "advantage estimator", "adv_type")
    gamma: float = field(0.99, "discount factor", ge=0, le=1)
    gae_lambda: float = field(0.95, "GAE lambda: 0 = one-step TD, 1 = Monte-Carlo", "lam", ge=0, le=1)
    normalize_adv: bool = field(True, "whiten advantages over the batch", "normalize_advantages")
    scale_rewards: Literal["group", "batch", "none"] = field(
        "group",
        "grpo, gigpo: divide each score minus its group's mean by the std of its group's scores (group), of "
        "the whole batch's scores (batch, grpo only: TRL's option), or by nothing (none: Dr. GRPO; verl's "
        "norm_adv_by_std_in_grpo: false)",
        "norm_adv_by_std_in_grpo",
    )

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _std_switch_as_scale(cls, value: Any) -> Any:
        """verl's ``norm_adv_by_std_in_grpo`` is a switch: true is the group's std, false none."""
        if isinstance(value, bool):
            return "group" if value else "none"
        return value

    step_advantage_weight: float = field(
        1.0,
        "gigpo (textenv): weight of the step-level advantage (each turn against the turns taken from the "
        "same state in its group, on the return discounted by algo.gamma) added to the episode's grpo advantage",
        "step_advantage_w",
        ge=0,
    )
    group_size: int = field(
        1,
        "samples per prompt (group estimators need >= 2); textenv: episodes per environment seed",
        "n_samples_per_prompt",
        ge=1,
    )
    lower_clip_ratio: float = field(0.2, "ratio clipped below at 1 - lower_clip_ratio", "clip_ratio_low", ge=0, lt=1)
    upper_clip_ratio: float = field(0.4, "ratio clipped above at 1 + upper_clip_ratio", "clip_ratio_high", ge=0)
    clip_ratio_c: float | None = field(None, "dual clip: bound of the loss for negative advantages (> 1)", gt=1)
    ratio_level: Literal["token", "sequence", "gspo"] = field(
        "token",
        "importance ratio per token; per sequence (the sum of its token log-ratios); or gspo, GSPO's "
        "length-normalised sequence ratio (use clip ratios of about 3e-4 / 4e-4 with it)",
    )
    loss_mode: PolicyLossName = field(
        "clip",
        "policy loss: clip (the clipped surrogate; aliases ppo, vanilla); penalty (the PPO paper's adaptive "
        "KL penalty, no clipping); cispo (clipped IS weight times the score, every token's gradient kept); "
        "dppo_tv / dppo_kl (a TV or binary-KL trust region on the token's probability, thresholds "
        "lower/upper_clip_ratio); gpg (the plain policy gradient); dro (the score with a quadratic log-ratio "
        "penalty, dro_beta); sapo (a soft sigmoid gate, sapo_tau_pos/neg); geo_mean (GMPO: the geometric "
        "mean of clipped token ratios per sequence); clip_cov / kl_cov (covariance-selected tokens detached "
        "or KL-penalised). Formulas: ppokit/algo/weighted_losses.py, surrogate_losses.py",
        "policy_loss",
    )
    sapo_tau_pos: float = field(1.0, "sapo: the gate's temperature for positive advantages", "tau_pos", gt=0)
    sapo_tau_neg: float = field(
        1.05, "sapo: the gate's temperature for negative advantages (> tau_pos fades them faster)", "tau_neg", gt=0
    )
    clip_cov_ratio: float = field(2e-4, "clip_cov: the share of valid tokens whose gradient is stopped", gt=0, le=1)
    clip_cov_lb: float = field(1.0, "clip_cov: tokens are drawn among covariances above this")
    clip_cov_ub: float = field(5.0, "clip_cov: ... and below this")
    kl_cov_ratio: float = field(2e-4, "kl_cov: the share of valid tokens (largest covariance) penalised", gt=0, le=1)
    kl_cov_coef: float = field(0.1, "kl_cov: the weight of |log r| on those tokens", "ppo_kl_coef", ge=0)
    dro_beta: float | None = field(
        None, "dro: the weight beta of the quadratic log-ratio penalty beta/2 (log r)^2 (required with dro)", gt=0
    )

    @field_validator("loss_mode", mode="before")
    @classmethod
    def _gspo_is_a_ratio(cls, name: Any) -> Any:
        """verl names GSPO a loss mode; here it is the clipped loss on GSPO's sequence ratio."""
        if name == "gspo":
            raise ValueError("GSPO is the clipped loss on its sequence ratio here: set algo.ratio_level=gspo")
        return name

    @field_validator("loss_mode")
    @classmethod
    def _canonical_loss(cls, name: str) -> str:
        """An alias (ppo, vanilla, ppo_penalty, gmpo) stands for its loss's one name."""
        return POLICY_LOSS_ALIASES.get(name, name)

    penalty_coef: float = field(
        1.0,
        "loss_mode=penalty: the initial KL coefficient (doubled or halved after each "
        "iteration to steer the KL towards penalty_target_kl)",
        gt=0,
    )
    penalty_target_kl: float = field(
        0.01,
        "loss_mode=penalty: the KL(old || new) per update the coefficient "
        "steers towards (x2 above 1.5 x target, /2 below target / 1.5)",
        gt=0,
    )
    clip_value: float | None = field(
        0.2, "value clipping around the old values (null = off)", "value_clip", "cliprange_value", "clip_range_vf", gt=0
    )
    huber_delta: float | None = field(None, "Huber value loss with this delta (null = squared error)", gt=0)
    value_coeff: float = field(0.5, "weight of the value loss", "vf_coef", "value_loss_coef", ge=0)
    entropy_coeff: float = field(
        0.0,
        "weight of the entropy bonus (>= 0: a negative weight would penalise exploration)",
        "entropy_bonus",
        "entropy_coef",
        "ent_coef",
        ge=0,
    )
    beta: float = field(
        0.0, "weight of the KL-to-reference term in the loss (> 0 needs a reference)", "kl_loss_coef", ge=0
    )
    kl_loss_type: KLEstimatorName = field(
        "low_var_kl",
        "KL estimator of the in-loss KL term (full: the exact KL "
        "over the vocabulary, from the logits, computed in chunks)",
    )
    kl_metric_rows: int = field(
        64,
        "lm, without a KL term (algo.beta = 0, no KL in the reward): the sequences of a batch whose "
        "reference log-probs measure the kl_ref metric, one reference pass over them (0 = kl_ref not "
        "measured, no reference pass)",
        ge=0,
    )
    use_kl_in_reward: bool = field(False, "subtract the KL to the reference from the reward")
    kl_penalty: KLEstimatorName = field(
        "kl", "KL estimator of the in-reward KL penalty (full: the exact KL over the vocabulary)"
    )
    kl_ctrl: KLControlConfig = field(KLControlConfig(), "in-reward KL coefficient controller")
    loss_agg_mode: AggModeName = field("token-mean", "how per-token losses are averaged", "loss_agg_func")
    target_kl: float | None = field(None, "stop the epochs of an update once approx_kl exceeds this", gt=0)
    credit: Literal["token", "turn"] = field(
        "token",
        "multi-turn episodes (textenv): token = GAE over the model's tokens, skipping environment tokens; "
        "turn = one value per turn (at its first token), GAE over turns, each turn's advantage on all its tokens",
    )
    rollout_correction: Literal["none", "tis", "mis"] = field(
        "none",
        "lm: correct for the rollout engine sampling from another distribution than the trainer computes "
        "(r = pi_old / pi_engine per token): none (the mismatch is only logged); tis = truncated importance "
        "weights min(r, cap) on the advantages (verl's rollout_is: token|sequence); mis = weights r, tokens or "
        "sequences outside [rollout_correction_lower, cap] dropped from the actor's loss (the weights of verl's "
        "IcePop, rollout_is_threshold 'lower_upper'); with rollout_correction_rs a rejection rule adds to either",
    )
    rollout_correction_level: Literal["token", "sequence", "geometric"] = field(
        "token",
        "the ratio the correction uses: token = each token's r; sequence = the product over the response; "
        "geometric = the geometric mean over the response (mis only)",
    )
    rollout_correction_cap: float = field(
        2.0, "the cap C: tis weights are min(r, C); mis keeps ratios up to C", "rollout_is_threshold", ge=1
    )
    rollout_correction_lower: float | None = field(
        None, "mis: the lowest ratio kept (null = 1 / rollout_correction_cap; 0 = no lower bound)", ge=0, le=1
    )
    rollout_correction_rs: str | None = field(
        None,
        "lm: rejection rules beside the weight (verl's rollout_rs), comma-separated, all must pass; with "
        "log r = log pi_old - log pi_engine per token: token_k1/k2/k3 drop a token, seq_sum_*, seq_mean_* and "
        "seq_max_* a whole response, by k1 = -log r (kept inside a ratio band), k2 = (log r)^2 / 2 or "
        "k3 = r - 1 - log r (kept up to a bound) per token, or their sum, mean or max over the response "
        "(seq_max: k2, k3); e.g. seq_mean_k3 (verl's K3-RS), seq_mean_k1 (Geo-RS), seq_sum_k1 (Seq-MIS)",
        "rollout_rs",
    )
    rollout_correction_rs_threshold: float | str | None = field(
        None,
        "the bounds of the rejection rules (verl's rollout_rs_threshold): one for all rules or one per rule, "
        "comma-separated; k2/k3: the largest statistic kept (e.g. 0.01); k1: 'lower_upper', the band of "
        "pi_engine / pi_old (e.g. 0.999_1.001), or one number U for the band [1/U, U]",
        "rollout_rs_threshold",
    )

    rollout_correction_bypass: bool = field(
        False,
        "lm: bypass mode (verl's bypass_mode): the engine's behaviour log-probs serve as pi_old, the "
        "scorer's actor pass is skipped and PPO's ratio pi / pi_engine with its clip does the correction "
        "(the rejection rules are then tested against the current policy in each pass)",
        "bypass_mode",
    )

    @field_validator("rollout_correction_rs_threshold", mode="before")
    @classmethod
    def _finite_threshold(cls, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a finite number, or a string such as '0.5_2.0' (got {value})")
        return value

    @property
    def rejection_rules(self) -> tuple[tuple[str, float | None, float], ...]:
        """``((rule, lower, upper), ...)`` of ``rollout_correction_rs`` (:func:`parse_rejection_rules`)."""
        return parse_rejection_rules(self.rollout_correction_rs, self.rollout_correction_rs_threshold)


# verl's rollout_rs rules; ppokit.algo.rollout_correction.REJECTION_RULES (tests/test_config.py checks they match)
REJECTION_RULE_NAMES = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def parse_rejection_rules(
    rules: str | None, threshold: float | str | None
) -> tuple[tuple[str, float | None, float], ...]:
    """verl's ``rollout_rs`` / ``rollout_rs_threshold`` syntax as ``((rule, lower, upper), ...)``.

    ``rules``: names of :data:`REJECTION_RULE_NAMES`, comma-separated (repeats dropped).
    ``threshold``: one bound for every rule, or one per rule (comma-separated). A k1 rule's
    bound is ``"lower_upper"`` (a band of ``pi_engine / pi_old``) or one number ``U`` (the band
    ``[1/U, U]``); a k2/k3 rule's is one positive number (``lower`` is None). ``()`` without rules.
    Raises ValueError with one line naming the problem."""
    if rules is None:
        return ()
    names = list(dict.fromkeys(part.strip() for part in rules.split(",") if part.strip()))
    if not names:
        raise ValueError(
            f"algo.rollout_correction_rs={rules!r} names no rule; valid: {', '.join(REJECTION_RULE_NAMES)}"
        )
    for name in names:
        if name not in REJECTION_RULE_NAMES:
            raise ValueError(
                f"algo.rollout_correction_rs: unknown rejection rule {name!r}"
                f"{did_you_mean(name, REJECTION_RULE_NAMES) or ';'} valid: {', '.join(REJECTION_RULE_NAMES)}"
            )
    if threshold is None:
        raise ValueError(
            f"algo.rollout_correction_rs={','.join(names)} needs algo.rollout_correction_rs_threshold "
            "(k2/k3: the largest statistic kept, e.g. 0.01; k1: a ratio band such as 0.999_1.001)"
        )
    specs = [str(threshold)] if isinstance(threshold, int | float) else [s.strip() for s in threshold.split(",")]
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"algo.rollout_correction_rs_threshold={threshold!r} gives {len(specs)} bounds for {len(names)} "
            "rules; give one bound for all rules or one per rule, comma-separated"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    out = []
    for name, spec in zip(names, specs):
        where = f"algo.rollout_correction_rs_threshold {spec!r} of rule {name}"
        parts = spec.split("_")
        try:
            values = [float(v) for v in parts]
        except ValueError:
            raise ValueError(f"{where} is not a number{' band lower_upper' if name.endswith('k1') else ''}") from None
        if not all(0 < v < float("inf") for v in values):
            raise ValueError(f"{where}: bounds must be positive and finite")
        if name.endswith("k1"):
            if len(values) > 2:
                raise ValueError(f"{where}: a k1 band is 'lower_upper' or one number")
            if len(values) == 1 and values[0] < 1:
                raise ValueError(
                    f"{where}: one number U is the band [1/U, U] and must be >= 1; write another band as "
                    "'lower_upper' in quotes (YAML reads 0.5_2 as the number 0.52)"
                )
            lower, upper = (1.0 / values[0], values[0]) if len(values) == 1 else values
            if lower > upper:
                raise ValueError(f"{where}: the lower bound is above the upper bound")
            out.append((name, lower, upper))
        else:
            if len(values) != 1:
                raise ValueError(f"{where}: a k2/k3 rule takes one upper bound, not a band")
            out.append((name, None, values[0]))
    return tuple(out)


class TrainConfig(Section):
    """The update loop: iterations, batches, optimizer, schedule."""

    iterations: int | None = field(None, "PPO iterations (collect + update); control may use total_steps", ge=1)
    total_steps: int | None = field(None, "control: environment steps to train for", "total_timesteps", ge=1)
    epochs: int = field(2, "passes over each batch", "ppo_epochs", "update_epochs", "n_epochs", ge=1)
    batch_size: int = field(256, "samples per iteration (control: num_envs * num_steps)", "local_batch_size", ge=1)
    mini_batch_size: int | None = field(
        None, "samples per optimizer step (null = the whole batch)", "ppo_mini_batch_size", ge=1
    )
    micro_batch_size: PositiveInt | Literal["auto"] | None = field(
        "auto",
        "samples per forward/backward pass (null = the mini-batch). lm: auto = the largest power of two "
        "(up to a learner's share of the mini-batch) whose update phase the memory estimate fits in half "
        "of the device's memory; the run's header says what it chose (docs/performance.md)",
        "ppo_micro_batch_size",
        "ppo_micro_batch_size_per_gpu",
    )
    infer_micro_batch_size: PositiveInt | Literal["auto"] = field(
        "auto",
        "samples per forward pass when scoring rollouts. auto = the largest power of two (up to the batch) "
        "whose scoring phase the memory estimate fits in half of the device's memory",
        "logprob_forward_micro_batch_size",
    )
    learning_rate: float = field(1e-5, "learning rate of the policy", "lr", gt=0)
    critic_learning_rate: float | None = field(
        1e-5, "learning rate of the critic (null = learning_rate)", "critic_lr", gt=0
    )
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = field(
        "constant", "learning-rate schedule after warm-up"
    )
    lr_warmup_ratio: float = field(0.01, "fraction of all optimizer steps spent warming up", ge=0, lt=1)
    grad_clip: float | None = field(0.2, "clip the norm of the actor's gradient (null = off)", "max_grad_norm", gt=0)
    critic_grad_clip: float | None = field(
        None, "clip the norm of the critic's gradient, value head included (null = train.grad_clip)", gt=0
    )
    adam_eps: float = field(1e-8, "Adam epsilon", gt=0)
    weight_decay: float = field(0.0, "AdamW weight decay", ge=0)
    critic_warmup: int = field(0, "iterations that train only the critic", ge=0)
    eval_patience: int = field(
        0,
        "stop training once this many periodic evaluations in a row (data.eval_every, textenv.eval_every "
        "or env.eval_every; none: the rule never fires) bring no new best held-out accuracy, win rate or "
        "return: the gain has stopped growing (0 = never)",
        ge=0,
    )
    max_bad_steps: int = field(
        10,
        "stop the run after this many optimizer steps in a row were skipped for a "
        "non-finite loss or gradient; the last good checkpoint stays (0 = never stop)",
        ge=0,
    )
    gradient_checkpointing: Literal["auto"] | bool = field(
        "auto",
        "lm: keep only each decoder layer's input for the update's backward pass and run the layer again "
        "there (transformers' activation checkpointing): the activations kept shrink to about one layer's, "
        "for about one more forward pass of time. auto = on on a GPU for models of at least 100M "
        "parameters, off on a CPU, where memory is rarely the limit (docs/performance.md)",
        "activation_checkpointing",
        "enable_gradient_checkpointing",
    )
    micro_batch_tokens: int | None = field(
        None,
        "lm: form the micro-batches of scoring and of the update by a token budget instead of a count "
        "(verl's use_dynamic_bsz): rows sorted by length are packed so that rows x longest row stays within "
        "this many tokens, the fewest micro-batches, balanced; each is cut to its own longest prompt and "
        "response. The loss is still exactly the mini-batch's (null = micro_batch_size and "
        "infer_micro_batch_size rows)",
        "max_token_len",
        "ppo_max_token_len_per_gpu",
        ge=1,
    )


class RunConfig(Section):
    """Where a run writes and how it reports."""

    output_dir: str = field("runs", "parent directory of run directories")
    name: str | None = field(None, "run directory name (null = <preset>-s<seed>-<time>)")
    device: str = field("auto", "auto, cpu, cuda or cuda:N", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")
    precision: Literal["auto", "fp32", "bf16"] = field("auto", "autocast precision (auto = bf16 where supported)")
    torch_threads: int | None = field(None, "torch intra-op threads (null = workload default)", ge=1)
    progress: bool = field(True, "live progress bar")
    memory_check: bool = field(
        True,
        "lm: before the start, estimate the memory of the run's largest phase from the config and the "
        "model's shape and refuse a run that cannot fit its device (a GPU's free memory, the machine's "
        "available memory); false: start anyway",
    )
    tensorboard: bool = field(True, "write TensorBoard events when tensorboard is installed")
    checkpoint_every: int = field(0, "save a checkpoint every N iterations (0 = only at the end)", ge=0)
    keep_checkpoints: int = field(3, "checkpoints kept on disk", ge=1)
    log_samples: int = field(
        4,
        "lm: rollout samples (prompt, response, reward, fields) written to "
        "RUN_DIR/samples.jsonl every run.samples_every iterations (0 = none)",
        ge=0,
    )
    wandb: bool = field(
        False,
        "also log metrics to Weights & Biases (needs the wandb package and a login, "
        "or WANDB_MODE=offline; beside TensorBoard)",
    )
    wandb_project: str = field("ppokit", "wandb: the project the run is logged to", min_length=1)
    wandb_entity: str | None = field(None, "wandb: the team or user (null = the login's default)")
    samples_every: int = field(10, "lm: iterations between the samples.jsonl entries (iteration 0 first)", ge=1)
    resume: Literal["never", "auto"] = field(
        "never",
        "auto: continue from the newest checkpoint in output_dir/name when there is one, else start "
        "fresh (needs run.name); never: a run directory that holds a run is refused",
    )

    @field_validator("name")
    @classmethod
    def _plain_directory_name(cls, name: str | None) -> str | None:
        if name is not None and (name in ("", ".", "..") or "/" in name or os.sep in name):
            raise ValueError(
                f"must be a plain directory name (got {name!r}); set the directory it goes in "
                "with run.output_dir (--output-dir)"
            )
        return name


class EnvConfig(Section):
    """Gymnasium environments (control workload)."""

    id: str = field("CartPole-v1", "Gymnasium environment id", "env_id")
    kwargs: dict[str, Any] = field({}, "keyword arguments for gymnasium.make")
    num_envs: int = field(8, "parallel environments", ge=1)
    num_steps: int = field(128, "steps per environment per iteration", "n_steps", ge=1)
    vectorization: Literal["auto", "vector_entry_point", "sync", "async"] = field(
        "auto", "vector env implementation (auto = Gymnasium's native one where it exists)"
    )
    normalize_obs: bool = field(False, "running mean/std observation normalization")
    normalize_reward: bool = field(False, "scale rewards by the running std of the discounted return")
    clip_obs: float = field(10.0, "clip normalized observations to +-clip_obs", gt=0)
    clip_reward: float = field(10.0, "clip normalized rewards to +-clip_reward", gt=0)
    truncation: Literal["bootstrap", "terminal"] = field(
        "bootstrap", "time-limit truncation: bootstrap from V(final obs), or treat as terminal (CleanRL)"
    )
    max_episode_steps: int | None = field(None, "override the env's time limit", ge=1)
    eval_episodes: int = field(10, "episodes of the deterministic evaluation at the end", ge=0)
    eval_every: int = field(0, "also evaluate every N iterations, in a separate vector env (0 = only at the end)", ge=0)
    stop_at_return: float | None = field(None, "stop training once a periodic evaluation reaches this mean return")

    @field_validator("kwargs")
    @classmethod
    def _time_limit_has_its_own_field(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        if "max_episode_steps" in kwargs:  # gymnasium.make's own argument: unchecked, and unseen by the evaluation
            raise ValueError(
                f"max_episode_steps={kwargs['max_episode_steps']!r} is the time limit: set env.max_episode_steps "
                "instead (a whole number, at least 1)"
            )
        if kwargs.get("render_mode") is not None:  # accepted by gymnasium, yet no frame would ever be shown or kept
            raise ValueError(
                f"render_mode={kwargs['render_mode']!r}: ppokit runs its environments without rendering, in training "
                "and evaluation alike; remove it"
            )
        return kwargs


class NetworkConfig(Section):
    """MLP actor-critic (control workload)."""

    hidden_sizes: list[Annotated[int, Field(ge=1)]] = field([64, 64], "hidden layer widths", min_length=1)
    activation: Literal["tanh", "relu", "gelu"] = field("tanh", "hidden activation")
    shared_trunk: bool = field(False, "actor and critic share the hidden layers")
    init_log_std: float = field(0.0, "continuous actions: initial log standard deviation")
    ortho_init: bool = field(True, "orthogonal init, gains sqrt(2) hidden, 0.01 policy head, 1 value head")


class ModelConfig(Section):
    """The language model (lm workload): policy, critic and reference."""

    path: str = field(
        "tiny",
        "local Hugging Face model directory, a GGUF file (converted once, ppokit[gguf]), or 'tiny' "
        "for the built-in tiny Llama (built in RUN_DIR/base_model, no download)",
        "model_name_or_path",
        "pretrain",
    )
    mode: Literal["lora", "full"] = field(
        "lora",
        "lora: actor and critic LoRA adapters on one frozen backbone, reference = adapters off; "
        "full: full fine-tuning, separate critic model, frozen reference copy only when a KL term needs it",
    )
    critic_path: str | None = field(None, "full mode: the model the critic starts from (null = model.path)")
    lora_rank: int = field(8, "LoRA rank of the actor and critic adapters", "lora_r", ge=1)
    lora_alpha: float = field(16.0, "LoRA alpha (the adapter output is scaled by alpha / rank)", gt=0)
    lora_target_modules: str | list[str] = field(
        "all-linear",
        "modules that get LoRA adapters (peft target_modules; all-linear = every linear layer but lm_head)",
    )
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2"] = field(
        "auto", "attention kernel (auto = eager on CPU, the model's default elsewhere)"
    )
    tiny_max_positions: int | None = field(
        None,
        "model.path=tiny: the positions of the built-in model (null = 64, or more when the longest prompt "
        "plus rollout.max_new_tokens needs it; the weights do not depend on it)",
        ge=8,
    )
    cpu_kernels: bool = field(
        True,
        "on a CPU (bf16 or fp32): fused C kernels for RMSNorm, SwiGLU, rotary embeddings and attention, "
        "and in bf16 on a CPU with AMX LoRA's rank-r products (built with the system C compiler on first use, "
        "about a second; without one, transformers' layers and PyTorch's matmuls are used)",
    )

    @field_validator("lora_target_modules")
    @classmethod
    def _some_target_modules(cls, names: str | list[str]) -> str | list[str]:
        if not names or (isinstance(names, list) and not all(isinstance(n, str) and n for n in names)):
            raise ValueError(
                f"must be one or more module names, none empty (got {names!r}); "
                "all-linear adapts every linear layer but lm_head"
            )
        return names


STATIC_CACHE_FULL_BF16 = (
    "rollout.cache_implementation=static does not work with model.mode=full under bf16 "
    "autocast; use the dynamic cache, model.mode=lora or run.precision=fp32"
)


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling (lm: single-turn prompts, and multi-turn groups of episodes of one seed,
    docs/multiturn.md; verl: ``algorithm.filter_groups``): groups of
    ``algo.group_size`` samples whose rewards are all equal (no advantage, no gradient) are
    dropped, and more prompts are drawn until ``train.batch_size`` rows are kept
    (:mod:`ppokit.algo.dynamic_sampling`). ``rollout.dynamic_sampling=true`` sets ``enable``."""

    enable: bool = field(
        False, "drop the prompt groups whose rewards are all equal and draw more prompts until the batch is full"
    )
    metric: Literal["reward", "verifier"] = field(
        "reward",
        "what must vary within a kept group: reward = the sequence reward (after shaping); verifier = "
        "data.reward's score alone (verl's acc / score), so that length penalties do not count as a signal",
    )
    max_gen_batches: int = field(
        10,
        "generation batches drawn per iteration at most, the first included (0 = no limit); at the limit the "
        "batch is filled up with dropped groups, as a run without dynamic sampling would train on",
        "max_num_gen_batches",
        ge=0,
    )


class RolloutConfig(Section):
    """Generation of responses (lm workload)."""

    temperature: float = field(1.0, "sampling temperature; log-probs are computed at the same temperature", gt=0)
    top_p: float = field(1.0, "nucleus sampling: keep the smallest token set with this much probability", gt=0, le=1)
    top_k: int = field(0, "sample among the k most likely tokens (0 = off)", ge=0)
    max_new_tokens: int = field(
        16,
        "response length limit; a response reaching it without EOS is truncated",
        "response_length",
        "max_response_length",
        ge=1,
    )
    micro_batch_size: int = field(64, "sequences per generate call", "rollout_micro_batch_size", ge=1)
    use_cache: bool = field(True, "KV cache during generation (false only to measure what it saves)")
    cache_implementation: Literal["dynamic", "static"] = field(
        "dynamic",
        "KV cache kind: dynamic grows step by step; static is preallocated, and on CUDA transformers "
        "compiles the decoding step around it (a one-time compile, then faster generation); lora mode, or "
        "fp32 in full mode",
    )
    engine: Literal["auto", "hf", "cuda"] = field(
        "auto",
        "what generates rollouts: hf = transformers' generate (any device); cuda = the CUDA-graph engine "
        "(CUDA only; other models fall back to hf with a note); auto = cuda on a CUDA device, measured 4.6-4.8x "
        "faster per iteration than hf (docs/performance.md), else hf",
    )
    off_policy_steps: int = field(
        0,
        "every workload, in process or on rollout workers: 0 = each iteration's rollout uses the "
        "newest weights; k = up to k rollouts are collected ahead, while the updates run (iteration i trains "
        "on the weights of version i - min(i, k); their log-probs are old_log_prob; the queued rollouts are "
        "checkpointed)",
        ge=0,
        le=8,
    )
    dynamic_sampling: DynamicSamplingConfig = field(
        DynamicSamplingConfig(),
        "lm: DAPO's dynamic sampling (true/false, or its settings); multi-turn (textenv): groups of "
        "algo.group_size episodes of one seed, filtered on their returns",
        "filter_groups",
    )


def rollout_options(base: RolloutConfig | None, **overrides: Any) -> RolloutConfig:
    """A :class:`RolloutConfig` from ``base`` (None: the defaults) with the ``overrides`` that are
    not None (``ppokit generate``/``chat``/``eval``'s sampling options), validated (a bad value is
    a one-line :class:`UserError` naming the option)."""
    values = base.model_dump() if base is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return RolloutConfig(**values)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc).replace("rollout.", "")) from None


class ClusterConfig(Section):
    """Scale-out on Ray (``pip install 'ppokit[ray]'``): rollout workers and a learner group."""

    rollout_workers: int = field(
        0, "Ray actors that collect rollouts, each a shard of the prompts or envs (0 = in the training process)", ge=0
    )
    learners: int = field(
        1,
        "learner processes on torch.distributed (1 with sharding=ddp: the learner is the training process, "
        "no process group)",
        ge=1,
    )
    sharding: Literal["ddp", "fsdp"] = field(
        "ddp",
        "ddp: every learner holds the whole model, its gradients and Adam moments (gradients all-reduced); "
        "fsdp: FSDP2 shards them over the learners (per decoder layer and the root; bf16 compute and fp32 "
        "gradient reduction with run.precision=bf16; a one-rank group when learners=1)",
    )
    cpu_offload: bool = field(
        False, "sharding=fsdp: keep the parameter, gradient and optimizer shards in CPU memory (FSDP2 CPU offload)"
    )
    sync_bucket_mb: float = field(
        256.0,
        "weights travel between the learners, the training process and the rollout workers in buckets of at "
        "most this many MiB, layer by layer (a larger tensor goes alone)",
        gt=0,
    )
    address: str | None = field(
        None, "Ray cluster to join: null starts a local Ray, 'auto' or host:port joins a running one (ray start --head)"
    )
    cpus_per_worker: float = field(1.0, "CPUs of each rollout worker and each learner", gt=0)
    gpus_per_worker: float = field(0.0, "GPUs of each rollout worker and each learner", ge=0)
    placement: Literal["colocated", "split"] = field(
        "split",
        "split: each worker and learner has its own resources; colocated: rollout worker i and "
        "learner i share one bundle (half of it each)",
    )
    placement_timeout: float = field(
        60.0, "seconds to wait for the cluster to place the workers before failing with the missing resources", gt=0
    )


class ShapingConfig(Section):
    """How the sequence reward is formed from its sources and shaped (lm workload), in this order:
    weighted sum of the sources, overlong and truncation penalties, clipping, normalisation."""

    verifier_weight: float = field(1.0, "weight of data.reward's score (the verifier) in the sum of sources")
    reward_model_weight: float = field(1.0, "weight of data.reward_model's score in the sum of sources")
    format_pattern: str | None = field(
        None,
        "a format check: a regular expression searched in each response (DOTALL); 1 when found, else 0, "
        "times format_weight, is added to the reward (null = no format check)",
    )
    format_weight: float = field(1.0, "weight of the format check's 0/1 score")
    overlong_cache_length: int | None = field(
        None,
        "DAPO's soft overlong punishment: responses longer than rollout.max_new_tokens - this many tokens "
        "lose up to overlong_penalty_factor, linearly (DAPO's L_cache; null = off)",
        "overlong_buffer_len",
        ge=1,
    )
    overlong_penalty_factor: float = field(
        1.0, "the overlong penalty at rollout.max_new_tokens tokens", "overlong_buffer_penalty_factor", ge=0
    )
    truncation_penalty: float = field(
        0.0, "subtracted from the reward of a response cut off by rollout.max_new_tokens without EOS (0 = off)", ge=0
    )
    clip_min: float | None = field(None, "clip the shaped reward below at this value (null = no bound)")
    clip_max: float | None = field(None, "clip the shaped reward above at this value (null = no bound)")
    normalize: Literal["none", "batch", "running"] = field(
        "none",
        "none; batch: (r - mean) / std over the batch; running: divide by the running std of all "
        "rewards so far (kept in checkpoints; the sign is kept)",
    )

    @model_validator(mode="after")
    def _clip_order(self) -> ShapingConfig:
        if self.clip_min is not None and self.clip_max is not None and self.clip_min > self.clip_max:
            raise ValueError(f"clip_min={self.clip_min} is above clip_max={self.clip_max}")
        if self.format_pattern is not None:
            try:
                re.compile(self.format_pattern)
            except re.error as exc:
                raise ValueError(
                    f"format_pattern {self.format_pattern!r} is not a regular expression ({exc})"
                ) from None
        return self

    @property
    def active(self) -> list[str]:
        """The shapings that change a reward, by name (for the run's header)."""
        out = []
        if self.overlong_cache_length is not None:
            out.append(
                f"overlong penalty (last {self.overlong_cache_length} tokens, factor {self.overlong_penalty_factor:g})"
            )
        if self.truncation_penalty:
            out.append(f"truncation penalty {self.truncation_penalty:g}")
        if self.clip_min is not None or self.clip_max is not None:
            out.append(f"clip to [{self.clip_min}, {self.clip_max}]")
        if self.normalize != "none":
            out.append(f"{self.normalize} normalisation")
        return out


class DataConfig(Section):
    """Prompts, reward function and held-out evaluation (lm workload)."""

    prompts: str = field(
        "arithmetic",
        "a built-in task (e.g. 'arithmetic:digits=2', 'countdown', 'gsm8k:path=train.jsonl', "
        "'reasoning_gym:chain_sum'), a JSONL or Parquet file, or a directory written by datasets' "
        "save_to_disk; a record's prompt_key field is the prompt, every other field goes to the "
        "reward function",
        "task",
        "dataset",
    )
    prompt_key: str = field("prompt", "the field (column) of a prompt file that holds the prompt", min_length=1)
    answer_key: str = field(
        "answer",
        "the field of a prompt file that the verifiers read as the answer (passed to the reward function as 'answer')",
        min_length=1,
    )
    max_prompt_tokens: int | None = field(
        None,
        "drop training and held-out prompts longer than this many tokens (the counts are printed and "
        "logged; null = keep all)",
        "max_prompt_length",
        ge=1,
    )
    reward: str | None = field(
        None, "reward function: a built-in name, 'module:fn' or 'file.py:fn' (null = the task's default)", "reward_fn"
    )
    reward_model: str | None = field(
        None,
        "a Hugging Face sequence-classification model directory (one "
        "output) whose score is the reward; with data.reward too, the sum; the "
        "held-out accuracy still uses data.reward or the task's own",
        "rm_path",
    )
    chat_template: bool = field(
        False,
        "render each prompt with the model's chat template as a user message "
        "(or a JSONL prompt given as a list of {role, content} messages), with the "
        "generation prompt; the reward function receives the rendered text",
    )
    reward_workers: int | None = field(
        None,
        "processes that run the reward function (null = the CPU count, at most 8); the cheap built-ins "
        "(exact_match, numeric_match, countdown) run in the trainer's process",
        ge=1,
    )
    reward_timeout: float = field(
        30.0,
        "seconds a reward function may take on one sample; past it the worker is "
        "killed and the sample gets data.reward_on_error",
        gt=0,
    )
    reward_on_error: float = field(
        0.0,
        "the reward of a sample whose reward function raised, hung or returned "
        "something that is not a finite number (counted, and marked in samples.jsonl)",
    )
    max_reward_errors: float | None = field(
        0.1,
        "stop the run when reward errors exceed this: a count (>= 1) over the whole run, or a fraction "
        "(< 1) of one batch (null = never stop)",
        ge=0,
    )
    shaping: ShapingConfig = field(
        ShapingConfig(), "reward sources' weights, format check, penalties, clipping and normalisation"
    )
    eval_prompts: str | None = field(
        None,
        "held-out prompts: a JSONL or Parquet file or a datasets directory, "
        "read with prompt_key and answer_key (null = the task's held-out split; "
        "with a prompt file and no eval file there is no evaluation)",
    )
    eval_size: int = field(64, "held-out prompts of the greedy accuracy evaluation before and after training", ge=0)
    eval_every: int = field(0, "also evaluate every N iterations (0 = before and after training only)", ge=0)
    stop_at_accuracy: float | None = field(
        None,
        "stop training once a periodic held-out evaluation (every data.eval_every iterations) reaches this accuracy",
        ge=0,
        le=1,
    )
    sft_epochs: int = field(
        0,
        "supervised warm start before PPO: at most this many epochs on the task's SFT "
        "split, keeping the best held-out model (0 = no warm start)",
        ge=0,
    )
    sft_examples: int = field(2000, "examples of the supervised warm start", ge=1)
    sft_batch_size: int = field(32, "sequences per supervised warm-start step", ge=1)
    sft_learning_rate: float = field(1e-3, "learning rate of the supervised warm start", gt=0)

    @field_validator("prompts", "eval_prompts")
    @classmethod
    def _a_source(cls, value: str | None) -> str | None:
        """An empty source (``data.prompts=``) is refused here, not once the run starts reading it."""
        if value is not None and not value.strip():
            raise ValueError(
                "empty: give a built-in task name (e.g. arithmetic), a JSONL or Parquet file, or a datasets directory"
            )
        return value

    @field_validator("max_reward_errors")
    @classmethod
    def _count_or_fraction(cls, value: float | None) -> float | None:
        if value is not None and value >= 1 and value != int(value):
            raise ValueError(f"a count of errors must be a whole number, a fraction of a batch below 1 (got {value})")
        return value


class OpponentPoolConfig(Section):
    """Self-play (textenv with a two-player environment that plays no seat itself, e.g.
    tictactoe with opponent: self): who plays the seat the learner does not."""

    snapshot_every: int = field(
        0,
        "add the current actor adapter to the pool of past opponents every N "
        "iterations (the starting policy goes in first); 0 = no pool: the current "
        "policy plays both seats",
        ge=0,
    )
    current_prob: float = field(
        0.5,
        "with a pool: probability that the other seat is played by the current "
        "policy (both seats then trained), else by a snapshot",
        ge=0,
        le=1,
    )
    sampling: Literal["uniform", "latest"] = field(
        "uniform", "how a snapshot is drawn: uniform over the pool, or the newest with probability latest_prob"
    )
    latest_prob: float = field(0.5, "sampling=latest: probability of the newest snapshot", ge=0, le=1)
    capacity: int = field(8, "snapshots kept (the oldest unpinned one is dropped; the starting policy is pinned)", ge=1)


class TextEnvConfig(Section):
    """Multi-turn episodes with a text environment (lm workload): games, puzzles, tools."""

    env: str | None = field(
        None,
        "a text environment: a built-in name (tictactoe, frozenlake, guess_number, "
        "calculator), textarena:<id> (a TextArena game, ppokit[textarena]), module:Class or "
        "path/to/file.py:Class; set, the lm workload trains "
        "on its episodes instead of data.prompts",
        "name",
        "id",
    )
    kwargs: dict[str, Any] = field({}, "keyword arguments for the environment's constructor")
    max_turns: int = field(
        32, "environment steps per episode (all seats); an episode that reaches it is truncated", ge=1
    )
    max_episode_tokens: int | None = field(
        None,
        "token budget of an episode: the model's tokens plus the observation tokens appended after the "
        "first observation (message mode); a turn starts only if rollout.max_new_tokens more still fit, else "
        "the episode is truncated (null = the model's context alone)",
        ge=1,
    )
    truncation: Literal["bootstrap", "terminal"] = field(
        "bootstrap",
        "an episode cut by a budget or the environment's time limit: bootstrap from the value of "
        "the next observation, or treat it as terminal (0); group estimators have no critic: terminal",
    )
    failure_reward: float = field(
        0.0,
        "reward of the step where the environment raised an exception (the "
        "episode ends there and is counted as failed)",
    )
    max_failure_rate: float = field(
        0.1, "stop the run when more than this fraction of an iteration's episodes failed", ge=0, le=1
    )
    seat: Literal["alternate", "random"] | int = field(
        "alternate", "self-play: the learner's seat in each episode (alternate, random, or a seat number)"
    )
    pool: OpponentPoolConfig = field(OpponentPoolConfig(), "self-play: the pool of past opponents")
    role_baseline_tau: float = field(
        0.0,
        "subtract a per-seat running mean of the episode's final reward "
        "(EMA with this rate; UnstableBaselines' role baseline); 0 = off",
        ge=0,
        le=1,
    )
    sft_policy: Literal["random", "random_wins", "expert"] = field(
        "random",
        "warm start (data.sft_epochs > 0): demonstrations by uniformly random legal actions (the format "
        "and the rules), the same keeping only the turns of seats that won (chosen by the outcome alone), or by "
        "the environment's expert_action()",
    )
    sft_eval_turns: int = field(
        256,
        "warm start: held-out demonstration turns that score each epoch (greedy generation: on a real model "
        "each turn costs a prompt's forward pass)",
        ge=1,
    )
    eval_episodes: int = field(200, "episodes of each evaluation (before, every eval_every, after)", ge=0)
    eval_sampling: Literal["greedy", "sampled"] = field(
        "greedy",
        "how the evaluation episodes pick replies: greedy (the most likely), or sampled at rollout.temperature "
        "as the rollouts are, on a random stream of the evaluation's own (the run's rollouts are the same "
        "either way); a policy that is greedy-stuck on an illegal move repeats it until the episode is cut",
    )
    eval_every: int = field(0, "also evaluate every N iterations (0 = before and after training only)", ge=0)
    stop_at_win_rate: float | None = field(
        None,
        "stop training once a periodic greedy evaluation (every textenv.eval_every iterations) reaches this "
        "win rate against the first of eval_opponents (the success rate without an opponent)",
        ge=0,
        le=1,
    )
    eval_opponents: list[str] = field(
        [],
        "environments that take an 'opponent' keyword (tictactoe): one evaluation against each before and "
        "after training (periodic evaluations: the first only), e.g. [random, heuristic]; empty = the "
        "training environment as configured",
    )

    @field_validator("seat", mode="before")
    @classmethod
    def _seat_number(cls, value: Any) -> Any:
        if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"a seat number must be a finite number (got {value})")
        return value


class Config(Section):
    """A whole run."""

    workload: Literal["control", "lm"] = field(
        "control", "which workload trains: control (Gymnasium) or lm (a causal language model)"
    )
    preset: str | None = field(None, "the preset or file this config came from (informational)")
    seed: int = field(1, "random seed of everything", ge=0, le=SEED_MAX)
    run: RunConfig = field(RunConfig(), "output and reporting")
    algo: AlgoConfig = field(AlgoConfig(), "PPO objective and advantage estimation")
    train: TrainConfig = field(TrainConfig(), "update loop and optimizer")
    env: EnvConfig = field(EnvConfig(), "control: Gymnasium environments")
    network: NetworkConfig = field(NetworkConfig(), "control: actor-critic network")
    model: ModelConfig = field(ModelConfig(), "lm: the language model, adapters, critic")
    rollout: RolloutConfig = field(RolloutConfig(), "lm: generation")
    data: DataConfig = field(DataConfig(), "lm: prompts, reward, evaluation, warm start")
    cluster: ClusterConfig = field(ClusterConfig(), "scale-out on Ray: rollout workers, learners")
    textenv: TextEnvConfig = field(TextEnvConfig(), "lm: multi-turn episodes with a text environment")

    @model_validator(mode="after")
    def _check_combinations(self) -> Config:
        """Settings that each field's own bounds cannot check: those of every run, then those of
        the run's kind (:data:`KIND_CHECKS`)."""
        if self.run.resume == "auto" and not self.run.name:
            raise ValueError("run.resume=auto needs a fixed run directory: set run.name")
        _check_objective(self)
        _check_batches(self)
        for check in KIND_CHECKS[self.kind]:
            check(self)
        _check_stopping_target(self)
        _check_dynamic_sampling(self)
        _check_cluster(self)
        _check_rollout_correction(self)
        _check_rollout(self)
        return self

    # ----------------------------------------------------------------- derived values
    @property
    def kind(self) -> str:
        """``control``; ``lm``, prompts and a reward (single-turn); ``textenv``, episodes of a text
        environment (``workload: lm`` with ``textenv.env`` set: multi-turn)."""
        return "textenv" if self.workload == "lm" and self.textenv.env is not None else self.workload

    @property
    def iterations(self) -> int:
        """Number of PPO iterations this run performs."""
        if self.train.iterations is not None:
            return self.train.iterations
        if self.train.total_steps is None:
            raise ConfigError("set train.iterations or train.total_steps")
        return max(1, self.train.total_steps // self.train.batch_size)

    @property
    def uses_critic(self) -> bool:
        """Whether the advantage estimator needs values (``gae``); GRPO, RLOO and REINFORCE++
        take their baseline from the rewards, and their lm runs build no critic."""
        return self.algo.adv_estimator == "gae"

    @property
    def mini_batch_size(self) -> int:
        return self.train.mini_batch_size or self.train.batch_size

    @property
    def micro_batch_size(self) -> int:
        """Rows per forward/backward pass; ``auto`` not yet resolved by the run
        (:func:`ppokit.lm.model.memory.resolve_micro_batches`): :data:`UNRESOLVED_MICRO_BATCH`."""
        micro = self.train.micro_batch_size
        if micro == "auto":
            micro = UNRESOLVED_MICRO_BATCH
        return min(micro or self.mini_batch_size, self.mini_batch_size)

    @property
    def infer_micro_batch_size(self) -> int:
        """Rows per scoring pass; ``auto`` not yet resolved by the run: :data:`UNRESOLVED_INFER_MICRO_BATCH`."""
        micro = self.train.infer_micro_batch_size
        return UNRESOLVED_INFER_MICRO_BATCH if micro == "auto" else micro

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------- combinations
# Each check raises ValueError (pydantic makes it the config's one-line error).
def _check_objective(cfg: Config) -> None:
    """The loss's and the estimator's own requirements."""
    a = cfg.algo
    if a.adv_estimator in GROUP_ESTIMATORS and a.group_size < 2:
        raise ValueError(
            f"algo.adv_estimator={a.adv_estimator} needs algo.group_size >= 2 "
            f"(got {a.group_size}): a group of one has no baseline"
        )
    if a.adv_estimator == "gigpo" and a.scale_rewards == "batch":
        raise ValueError(
            "algo.scale_rewards=batch applies to grpo; gigpo divides each of its terms by the std of its own "
            "group (group) or by nothing (none)"
        )
    if a.adv_estimator == "gigpo" and cfg.kind != "textenv":
        raise ValueError(
            "algo.adv_estimator=gigpo compares the turns that multi-turn episodes (textenv) take from one "
            "state; single-turn samples have one turn each (use grpo) and control takes gae"
        )
    if a.loss_mode == "dro" and a.dro_beta is None:
        raise ValueError(
            "algo.loss_mode=dro needs algo.dro_beta > 0, the weight of its penalty beta/2 (log r)^2 (e.g. 0.1)"
        )
    if a.loss_mode in TOKEN_RATIO_LOSSES and a.ratio_level != "token":
        raise ValueError(
            f"algo.ratio_level={a.ratio_level} applies to loss_mode clip or penalty; {a.loss_mode} has its own "
            "ratio: set algo.ratio_level=token"
        )
    if a.loss_mode == "clip_cov" and not a.clip_cov_lb < a.clip_cov_ub:
        raise ValueError(
            f"algo.clip_cov_lb={a.clip_cov_lb} must be below algo.clip_cov_ub={a.clip_cov_ub}: "
            "tokens are drawn from the covariances between them"
        )
    if a.adv_estimator == "gae" and a.value_coeff == 0:
        raise ValueError("algo.adv_estimator=gae needs a trained critic; algo.value_coeff must be > 0")


def _check_batches(cfg: Config) -> None:
    """The batch, its groups and its mini-batches divide evenly."""
    a, t = cfg.algo, cfg.train
    if t.batch_size % a.group_size:
        raise ValueError(f"train.batch_size={t.batch_size} must be a multiple of algo.group_size={a.group_size}")
    if t.mini_batch_size is not None:
        if t.mini_batch_size > t.batch_size:
            raise ValueError(
                f"train.mini_batch_size={t.mini_batch_size} is larger than train.batch_size={t.batch_size}; set it "
                f"to a divisor of the batch, e.g. {_divisors_near(t.batch_size, t.batch_size // 4)}"
            )
        if t.batch_size % t.mini_batch_size:
            raise ValueError(
                f"train.mini_batch_size={t.mini_batch_size} must divide "
                f"train.batch_size={t.batch_size} (try {_divisors_near(t.batch_size, t.mini_batch_size)})"
            )
    cache = cfg.data.shaping.overlong_cache_length
    if cache is not None and cache > cfg.rollout.max_new_tokens:
        raise ValueError(
            f"data.shaping.overlong_cache_length={cache} is longer than rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}: the penalty ramps over the last tokens before that limit"
        )


def _check_control(cfg: Config) -> None:
    """The control workload: its batch is its envs' steps, and a language model's settings are refused."""
    a, t = cfg.algo, cfg.train
    if cfg.textenv.env is not None:
        raise ValueError(f"textenv.env={cfg.textenv.env} trains a language model; set workload: lm")
    if a.beta > 0 or a.use_kl_in_reward:
        what = "algo.beta > 0" if a.beta > 0 else "algo.use_kl_in_reward"
        raise ValueError(
            f"{what} needs a reference policy, which the control workload does not have; "
            "set algo.beta=0 and algo.use_kl_in_reward=false"
        )
    if a.adv_estimator in GROUP_ESTIMATORS:
        raise ValueError(
            f"algo.adv_estimator={a.adv_estimator} compares samples of one prompt and needs "
            "the lm workload; use gae for control"
        )
    expected = cfg.env.num_envs * cfg.env.num_steps
    if t.batch_size != expected:
        raise ValueError(
            f"train.batch_size={t.batch_size} must equal env.num_envs * env.num_steps "
            f"= {expected} for the control workload (or leave it out)"
        )
    if t.total_steps is None and t.iterations is None:
        raise ValueError("set train.total_steps (environment steps) or train.iterations")
    if t.micro_batch_tokens is not None:
        raise ValueError(
            "train.micro_batch_tokens forms micro-batches of token sequences (lm workload); "
            "control batches use train.micro_batch_size"
        )
    if cfg.rollout.dynamic_sampling.enable:
        raise ValueError(
            "rollout.dynamic_sampling filters groups of a language model's responses; the control "
            "workload has none: set rollout.dynamic_sampling=false"
        )
    if a.rollout_correction != "none":
        raise ValueError(
            f"algo.rollout_correction={a.rollout_correction} corrects a language model's rollout engine; "
            "control rollouts sample from the trained network itself: set algo.rollout_correction=none"
        )
    if a.rollout_correction_rs is not None or a.rollout_correction_bypass:
        what = "algo.rollout_correction_bypass" if a.rollout_correction_bypass else "algo.rollout_correction_rs"
        raise ValueError(
            f"{what} needs a language model's rollout engine and its behaviour log-probs; control "
            f"rollouts sample from the trained network itself: remove {what}"
        )
    c = cfg.cluster
    if c.rollout_workers > 1 and cfg.env.num_envs % c.rollout_workers:
        raise ValueError(
            f"cluster.rollout_workers={c.rollout_workers} must divide env.num_envs="
            f"{cfg.env.num_envs}: each worker steps an equal shard of the envs"
        )


def _check_lm(cfg: Config) -> None:
    """Language-model runs, single- and multi-turn: the budget, the critic's settings, the workers' shares."""
    a, t = cfg.algo, cfg.train
    if t.iterations is None:
        raise ValueError("set train.iterations (PPO iterations) for the lm workload")
    if t.critic_warmup and not cfg.uses_critic:
        raise ValueError(
            f"train.critic_warmup={t.critic_warmup} trains the critic, but "
            f"algo.adv_estimator={a.adv_estimator} has none; set train.critic_warmup=0"
        )
    if t.critic_warmup >= t.iterations:
        raise ValueError(
            f"train.critic_warmup={t.critic_warmup} leaves no actor updates in train.iterations={t.iterations}"
        )
    critic_path = cfg.model.critic_path
    if critic_path and not cfg.uses_critic:
        raise ValueError(
            f"model.critic_path={critic_path} is the critic's model, but "
            f"algo.adv_estimator={a.adv_estimator} trains no critic; remove model.critic_path"
        )
    if critic_path and cfg.model.mode == "lora":
        raise ValueError(
            f"model.critic_path={critic_path} is full mode's separate critic; in lora mode "
            "the critic is a LoRA adapter on model.path: set model.mode=full, or remove "
            "model.critic_path"
        )


def _check_textenv(cfg: Config) -> None:
    """Multi-turn episodes (``textenv``): the estimators and credit they take, self-play's pool,
    the rollout workers' shares and the filter of dynamic sampling."""
    a, t, c = cfg.algo, cfg.train, cfg.cluster
    if a.adv_estimator != "gae" and a.adv_estimator not in GROUP_ESTIMATORS:
        raise ValueError(
            f"algo.adv_estimator={a.adv_estimator}: multi-turn episodes (textenv) take gae (the "
            f"critic) or a group estimator ({', '.join(GROUP_ESTIMATORS)}) over episodes of one seed"
        )
    if a.adv_estimator == "gae" and a.group_size != 1:
        raise ValueError(
            f"algo.group_size={a.group_size}: with algo.adv_estimator=gae multi-turn episodes (textenv) "
            "use the critic as the baseline; set algo.group_size=1, or a group estimator such as grpo"
        )
    if a.adv_estimator in GROUP_ESTIMATORS and a.credit == "turn":
        raise ValueError(
            f"algo.credit=turn is GAE over turns with the critic; algo.adv_estimator={a.adv_estimator} "
            "puts each episode's group advantage on all its tokens: set algo.credit=token"
        )
    if a.adv_estimator in GROUP_ESTIMATORS and cfg.textenv.role_baseline_tau:
        raise ValueError(
            f"textenv.role_baseline_tau: algo.adv_estimator={a.adv_estimator} already compares each "
            "episode with episodes of the same seed and seat; set textenv.role_baseline_tau=0"
        )
    if cfg.textenv.pool.snapshot_every and cfg.model.mode != "lora":
        raise ValueError(
            "textenv.pool.snapshot_every: past opponents are LoRA actor adapters; set "
            "model.mode=lora, or textenv.pool.snapshot_every=0"
        )
    if c.rollout_workers > 1 and t.batch_size % c.rollout_workers:
        raise ValueError(
            f"cluster.rollout_workers={c.rollout_workers} must divide train.batch_size="
            f"{t.batch_size}: each worker plays an equal, contiguous share of the episodes"
        )
    if cfg.rollout.dynamic_sampling.enable and cfg.rollout.dynamic_sampling.metric == "verifier":
        raise ValueError(
            "rollout.dynamic_sampling.metric=verifier is data.reward's score; multi-turn episodes (textenv) "
            "are filtered on their return: set rollout.dynamic_sampling.metric=reward"
        )


def _check_group_shares(cfg: Config) -> None:
    """Each rollout worker gets whole groups (language-model runs, after their own checks)."""
    c, t, a = cfg.cluster, cfg.train, cfg.algo
    if c.rollout_workers > 1 and (t.batch_size // a.group_size) % c.rollout_workers:
        raise ValueError(
            f"cluster.rollout_workers={c.rollout_workers} must divide the prompts per iteration "
            f"(train.batch_size / algo.group_size = {t.batch_size // a.group_size})"
        )


# each kind's checks, after those of every run (Config.kind)
KIND_CHECKS = {
    "control": (_check_control,),
    "lm": (_check_lm, _check_group_shares),
    "textenv": (_check_lm, _check_textenv, _check_group_shares),
}
# each kind's stopping target (ppokit.monitoring.stopping)
STOPPING_TARGETS = {
    "control": "env.stop_at_return",
    "lm": "data.stop_at_accuracy",
    "textenv": "textenv.stop_at_win_rate",
}


def _check_stopping_target(cfg: Config) -> None:
    """A stopping target of another kind than the run's is an error. (A rule without periodic
    evaluations never fires: a preset's target stays valid when eval_every is set to 0.)"""
    own = STOPPING_TARGETS[cfg.kind]
    targets = {
        "env.stop_at_return": cfg.env.stop_at_return,
        "data.stop_at_accuracy": cfg.data.stop_at_accuracy,
        "textenv.stop_at_win_rate": cfg.textenv.stop_at_win_rate,
    }
    for name, value in targets.items():
        if value is not None and name != own:
            raise ValueError(f"{name} is another workload's stopping target; this run stops on {own}")


def _check_dynamic_sampling(cfg: Config) -> None:
    """rollout.dynamic_sampling filters the groups of single-turn prompts and of multi-turn
    episodes (in the training process or on rollout workers), each generation batch sampled by
    the weights of the iteration's first one."""
    if not cfg.rollout.dynamic_sampling.enable:
        return
    if cfg.algo.group_size < 2:
        raise ValueError(
            f"rollout.dynamic_sampling keeps the groups whose rewards vary, so it needs algo.group_size >= 2 "
            f"(got {cfg.algo.group_size}): set algo.group_size (e.g. 8)"
        )
    if cfg.rollout.off_policy_steps and cfg.cluster.rollout_workers:
        raise ValueError(
            f"rollout.dynamic_sampling with rollout.off_policy_steps={cfg.rollout.off_policy_steps} runs in "
            "the training process only (on rollout workers its extra generation batches would be sampled by "
            "newer weights than the first): set cluster.rollout_workers=0 or rollout.off_policy_steps=0"
        )


def _check_cluster(cfg: Config) -> None:
    """Sharding and the learners' split of a mini-batch."""
    c, t = cfg.cluster, cfg.train
    if c.cpu_offload and c.sharding != "fsdp":
        raise ValueError(
            "cluster.cpu_offload keeps FSDP shards in CPU memory: set cluster.sharding=fsdp, or "
            "cluster.cpu_offload=false"
        )
    if c.learners > 1 and (t.mini_batch_size or t.batch_size) < c.learners:
        raise ValueError(
            f"cluster.learners={c.learners} split each mini-batch; train.mini_batch_size="
            f"{t.mini_batch_size or t.batch_size} gives some learner no sample"
        )


def _check_rollout_correction(cfg: Config) -> None:
    """The correction's weight, its rejection rules and bypass mode, together."""
    a = cfg.algo
    if a.rollout_correction == "tis" and a.rollout_correction_level == "geometric":
        raise ValueError(
            "algo.rollout_correction_level=geometric is a band test of mis (a geometric mean is no "
            "importance weight); use token or sequence with tis, or algo.rollout_correction=mis"
        )
    if a.rollout_correction_rs is None and a.rollout_correction_rs_threshold is not None:
        raise ValueError(
            "algo.rollout_correction_rs_threshold bounds the rejection rules, but algo.rollout_correction_rs "
            "names none; set algo.rollout_correction_rs (e.g. seq_mean_k3) or remove the threshold"
        )
    if a.rollout_correction_lower is not None and a.rollout_correction != "mis":
        raise ValueError(
            f"algo.rollout_correction_lower is the lowest ratio mis keeps, but algo.rollout_correction="
            f"{a.rollout_correction} keeps every ratio; set algo.rollout_correction=mis or remove the bound"
        )
    a.rejection_rules  # noqa: B018  (a bad rule or bound: ValueError)
    if a.rollout_correction_bypass and a.rollout_correction != "none":
        raise ValueError(
            f"algo.rollout_correction={a.rollout_correction} weighs by pi_old / pi_engine, which bypass mode "
            "makes 1 (pi_old = pi_engine; PPO's ratio corrects): set algo.rollout_correction=none, or "
            "algo.rollout_correction_bypass=false"
        )
    if a.rollout_correction_bypass and (cfg.rollout.top_p < 1 or cfg.rollout.top_k):
        raise ValueError(
            "algo.rollout_correction_bypass: the engine's log-probs come from the top-p/top-k truncated "
            "distribution, the update's from the whole one, so PPO's ratio would not start at 1; set "
            "rollout.top_p=1 and rollout.top_k=0, or algo.rollout_correction_bypass=false"
        )


def _check_rollout(cfg: Config) -> None:
    """The rollout engine and its KV cache against the device and precision."""
    r = cfg.rollout
    if r.engine == "cuda" and cfg.run.device in ("cpu", "mps"):
        raise ValueError(
            f"rollout.engine=cuda needs a CUDA device, but run.device={cfg.run.device}; set rollout.engine=auto (or hf)"
        )
    if r.cache_implementation == "static" and not r.use_cache:
        raise ValueError("rollout.cache_implementation=static is a KV cache: it needs rollout.use_cache=true")
    if r.cache_implementation == "static" and cfg.model.mode == "full" and cfg.run.precision == "bf16":
        raise ValueError(STATIC_CACHE_FULL_BF16)  # precision=auto: checked by HFEngine.for_policy


# what an ``auto`` micro-batch size means where no run resolved it (a checkpoint's config read back
# by ppokit eval, a policy built by hand): the sizes that fit any model the memory check lets start
UNRESOLVED_MICRO_BATCH = 1
UNRESOLVED_INFER_MICRO_BATCH = 4


def _divisors_near(n: int, k: int) -> str:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    best = sorted(divisors, key=lambda d: abs(d - k))[:2]
    return " or ".join(str(d) for d in sorted(best))


# Defaults that differ by workload. Applied below the preset and user layers, and only
# to keys the user did not set. The field defaults are language-model defaults; a
# Gymnasium task wants CleanRL's.
WORKLOAD_DEFAULTS: dict[str, dict[str, Any]] = {
    "control": {
        "algo": {"upper_clip_ratio": 0.2, "clip_value": None},
        "train": {
            "total_steps": 100_000,
            "epochs": 10,
            "mini_batch_size": None,
            "micro_batch_size": None,
            "learning_rate": 3e-4,
            "critic_learning_rate": None,
            "lr_scheduler_type": "linear",
            "lr_warmup_ratio": 0.0,
            "grad_clip": 0.5,
            "adam_eps": 1e-5,
        },
    },
    # The field defaults are the language-model settings; only a budget is added.
    "lm": {"train": {"iterations": 100}},
}


# ----------------------------------------------------------------------------- loading
class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A key given twice in one mapping of a YAML document."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error (not "the last
    wins"), and floats in exponent form without a dot or an exponent sign (``2e5``, ``1e-4``,
    ``-3E2``: YAML 1.2 floats that YAML 1.1 reads as strings) are numbers."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in first_line:
                    raise DuplicateKeyError(
                        None,
                        None,
                        f"key '{key}' is given twice (first on line {first_line[key]}); keep one",
                        key_node.start_mark,
                    )
                first_line[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: SafeLoader says so
                continue
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_config(source: str | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated :class:`Config` from a preset name or YAML path plus overrides.

    Raises :class:`ConfigError` with a message naming the field for any problem.
    """
    layers: list[dict[str, Any]] = []
    label = None
    user = parse_overrides(overrides or [])
    if source is not None:
        file_layer, label = _read_source(source)
        layers.append(file_layer)
        layers += mode_layer(file_layer, user, source)
    layers.append(user)
    return build_config(layers, label)


def mode_layer(file_layer: dict[str, Any], user: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """A config file's ``model_mode`` section, popped from ``file_layer``: the layer for the run's
    model mode (``model.mode`` as the user's overrides or the file set it), if the file has one.
    It lies over the file and under the user's overrides, so that one file can give each mode
    its own settings (LoRA adapters and a full fine-tune want learning rates ~20x apart)::

        train: {learning_rate: 0.002}
        model_mode:
          full: {train: {learning_rate: 1.0e-4}}
    """
    sections = file_layer.pop("model_mode", None)
    if sections is None:
        return []
    modes = get_args(ModelConfig.model_fields["mode"].annotation)
    if not isinstance(sections, dict) or not all(isinstance(v, dict) for v in sections.values()):
        raise ConfigError(f"{source}: model_mode must map a model mode ({', '.join(modes)}) to config sections")
    unknown = [k for k in sections if k not in modes]
    if unknown:
        raise ConfigError(f"{source}: model_mode.{unknown[0]} is not a model mode; modes: {', '.join(modes)}")
    mode = None
    for layer in (file_layer, user):  # the later wins, as in build_config
        model = canonicalize(layer, Config, "").get("model")
        if isinstance(model, dict) and "mode" in model:
            mode = model["mode"]
    mode = mode if mode is not None else ModelConfig.model_fields["mode"].default
    return [sections[mode]] if isinstance(mode, str) and mode in sections else []  # a bad mode: validation says so


def build_config(layers: list[dict[str, Any]], label: str | None = None) -> Config:
    """Merge raw layers (already parsed dicts, later wins) over the defaults and validate."""
    canonical = [canonicalize(layer, Config, "") for layer in layers]
    user = {}
    for layer in canonical:
        _drop_other_environments_arguments(user, layer)
        deep_merge(user, layer)
    workload = user.get("workload", Config.model_fields["workload"].default)
    raw = copy.deepcopy(WORKLOAD_DEFAULTS.get(workload, {})) if isinstance(workload, str) else {}
    deep_merge(raw, user)
    if label is not None and "preset" not in raw:
        raw["preset"] = label
    user_train = user.get("train") if isinstance(user.get("train"), dict) else {}
    if workload == "control" and "batch_size" not in user_train and isinstance(raw.get("train", {}), dict):
        env = raw.get("env", {}) if isinstance(raw.get("env"), dict) else {}
        num_envs = env.get("num_envs", EnvConfig.model_fields["num_envs"].default)
        num_steps = env.get("num_steps", EnvConfig.model_fields["num_steps"].default)
        if isinstance(num_envs, int) and isinstance(num_steps, int):
            raw.setdefault("train", {})["batch_size"] = num_envs * num_steps
    if user_train.get("iterations") is not None and "total_steps" not in user_train:
        raw["train"].pop("total_steps", None)  # an iteration budget replaces the default step budget
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


# (section, its environment's name): the section's ``kwargs`` are that environment's arguments
ENVIRONMENT_KEYS = (("env", "id"), ("textenv", "env"))


def _constructor(name: Any) -> Any:
    """What takes an environment's ``kwargs``: every ``textarena:<id>`` game is built by one wrapper
    (ppokit.envs.textarena: ``view``, ``instruction``, ``opponent``... for any game)."""
    return "textarena:" if isinstance(name, str) and name.startswith("textarena:") else name


def _drop_other_environments_arguments(merged: dict[str, Any], layer: dict[str, Any]) -> None:
    """A layer that names an environment another constructor builds (``textenv.env=textarena:KuhnPoker-v0``
    over the tictactoe preset's built-in game) drops the earlier layers' ``kwargs``: they were the
    other one's arguments (``policy_seat: x``, refused by the TextArena wrapper: a value the user never
    wrote). Keys the layer gives inside ``kwargs`` then start from an empty mapping."""
    for section, name in ENVIRONMENT_KEYS:
        before, update = merged.get(section), layer.get(section)
        named = isinstance(before, dict) and isinstance(update, dict) and name in update and name in before
        if named and _constructor(update[name]) != _constructor(before[name]):
            before.pop("kwargs", None)


def _read_source(source: str) -> tuple[dict[str, Any], str]:
    """A YAML file, else a preset name; a directory of the same name does not hide a preset."""
    path = Path(source)
    if path.is_file():
        return read_yaml(path), path.stem
    if source in preset_names():
        return read_yaml(PRESET_DIR / f"{source}.yaml"), source
    choices = f"a preset ({', '.join(preset_names())})"
    if path.is_dir():
        raise ConfigError(f"config '{source}' is a directory; give a YAML file or {choices}")
    if path.exists():
        raise ConfigError(f"config '{source}' is not a regular file; give a YAML file or {choices}")
    if path.suffix in (".yaml", ".yml"):
        raise ConfigError(f"config file '{source}' does not exist; give a YAML path or {choices}")
    raise ConfigError(
        f"unknown preset '{source}'{did_you_mean(source, preset_names()) or ';'} "
        f"presets: {', '.join(preset_names())}; or give a path to a YAML file"
    )


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if isinstance(exc, DuplicateKeyError):
            raise ConfigError(f"{path}{where}: {problem}") from None
        raise ConfigError(f"{path}{where}: not valid YAML ({problem})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["algo.gamma=0.9", "seed=3"]`` -> ``{"algo": {"gamma": 0.9}, "seed": 3}`` (values parsed as YAML)."""
    result: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}' must look like section.key=value, e.g. algo.gamma=0.99")
        try:
            value = yaml.load(text, Loader=_Loader) if text != "" else ""
        except DuplicateKeyError as exc:
            raise ConfigError(f"override '{item}': {exc.problem}") from None
        except yaml.YAMLError:
            value = text
        if isinstance(value, dict) and text.rstrip().endswith(":") and not text.lstrip().startswith("{"):
            value = text  # 'reasoning_gym:' is a name cut short, not the mapping {reasoning_gym: null}
        node = result
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, _DottedKeys())
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override of '{part}'")
            node = child
        node[parts[-1]] = value
    return result


class _DottedKeys(dict):
    """The keys an override names inside a mapping (``textenv.kwargs.opponent=self``): they merge
    into a ``kwargs`` mapping of an earlier layer, where a whole ``kwargs`` mapping replaces it
    (an environment's arguments are not mixed with another environment's)."""


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Merge ``update`` into ``base`` in place; nested dicts merge, other values replace (a
    ``kwargs`` mapping replaces, unless an override named keys inside it: :class:`_DottedKeys`)."""
    for key, value in update.items():
        merges = key != "kwargs" or isinstance(value, _DottedKeys)
        if isinstance(value, dict) and isinstance(base.get(key), dict) and merges:
            deep_merge(base[key], value)
        else:
            base[key] = _plain(copy.deepcopy(value))
    return base


def _plain(value: Any) -> Any:
    """``value`` with every :class:`_DottedKeys` mapping in it a plain dict (it has merged)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _section_type(annotation: Any) -> type[Section] | None:
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    for arg in get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, Section):
            return arg
    return None


def _aliases(model: type[Section]) -> dict[str, str]:
    table = {}
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        for alias in extra.get("aliases", []):
            table[alias] = name
    return table


def canonicalize(raw: dict[str, Any], model: type[Section], prefix: str) -> dict[str, Any]:
    """Rename aliases to canonical names (recursively); reject a key given twice."""
    if not isinstance(raw, dict):
        return raw
    aliases = _aliases(model)
    out: dict[str, Any] = {}
    source_of: dict[str, str] = {}
    items = [(key, key, value) for key, value in raw.items()]  # (key as given, key, value)
    if model is AlgoConfig:
        items = _expand_algo_shorthands(items, prefix)
    for given, key, value in items:
        if not isinstance(key, str):
            raise ConfigError(f"{prefix}{key!r}: config keys must be strings")
        name = aliases.get(key, key)
        if name in out:
            raise ConfigError(f"{prefix}{name} is given twice (as '{source_of[name]}' and '{given}'); keep one")
        info = model.model_fields.get(name)
        if info is not None:
            sub = _section_type(info.annotation)
            if sub is not None and isinstance(value, bool) and "enable" in sub.model_fields:
                value = {"enable": value}  # a section with an on/off switch: true/false sets it
            if sub is not None and isinstance(value, dict):
                value = canonicalize(value, sub, f"{prefix}{name}.")
            elif name in _VALUE_ALIASES and isinstance(value, str):
                value = _VALUE_ALIASES[name].get(value, value)
        out[name] = value
        source_of[name] = given
    return out


def _expand_algo_shorthands(items: list[tuple[Any, Any, Any]], prefix: str) -> list[tuple[Any, Any, Any]]:
    """``clip_ratio``/``clip_coef`` set both clip bounds; verl's ``use_kl_loss: false`` means beta 0.

    ``items`` and the result are ``(key as given, key, value)``."""
    out = []
    use_kl_loss = None
    for given, key, value in items:
        if key in ("clip_ratio", "clip_coef", "clip_range", "cliprange"):
            out += [(given, "lower_clip_ratio", value), (given, "upper_clip_ratio", value)]
        elif key == "use_kl_loss":
            if not isinstance(value, bool):
                raise ConfigError(f"{prefix}use_kl_loss: expected true or false, got {value!r}")
            use_kl_loss = value
        else:
            out.append((given, key, value))
    if use_kl_loss is False:
        out = [item for item in out if item[1] not in ("beta", "kl_loss_coef")] + [("use_kl_loss", "beta", 0.0)]
    elif use_kl_loss is True and not any(key in ("beta", "kl_loss_coef") for _, key, _ in out):
        out.append(("use_kl_loss", "beta", 0.001))  # verl's default kl_loss_coef
    return out


# ------------------------------------------------------------------------ error messages
def _model_at(loc: tuple[Any, ...]) -> type[Section] | None:
    model: type[Section] | None = Config
    for part in loc:
        if model is None or part not in model.model_fields:
            return None
        model = _section_type(model.model_fields[part].annotation)
    return model


_TYPE_NAMES = {
    "str": "a string",
    "list[str]": "a list of strings",
    "int": "an integer",
    "constrained-int": "a positive integer",
    "float": "a number",
    "bool": "true or false",
}


def format_validation_error(exc: ValidationError) -> str:
    """All problems on one line, "; " between them: ``algo.gamma: Input should be <= 1 (got 1.5)``.

    The branches of a union field (``model.lora_target_modules``: a string or a list of
    strings) make one problem: ``must be a string or a list of strings (got 5)``.
    """
    problems = []
    unions: dict[tuple[Any, ...], dict[str, Any]] = {}  # field -> its branches and the value given
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        field_loc = _union_field(loc)
        if field_loc is None:
            loc = tuple(p for p in loc if not (isinstance(p, str) and p.startswith("literal[")))
            problems.append(_describe_error(err, loc))
            continue
        union = unions.setdefault(field_loc, {"branches": []})
        union["branches"] += [loc[len(field_loc)]] if loc[len(field_loc)] not in union["branches"] else []
        if len(loc) == len(field_loc) + 1:  # an error about the whole value, not one of its items
            union.setdefault("got", err.get("input"))
    for field_loc, union in unions.items():
        got = f" (got {union['got']!r})" if "got" in union else ""
        kinds = " or ".join(_branch_name(b) for b in union["branches"])
        problems.append(f"{'.'.join(field_loc)}: must be {kinds}{got}")
    return "; ".join(problems)


def _branch_name(branch: str) -> str:
    """A union branch in words: ``a positive integer``, ``auto`` (a literal's values), ``a string``."""
    if branch.startswith("literal["):
        return " or ".join(re.findall(r"'([^']*)'", branch)) or branch
    return _TYPE_NAMES.get(branch, branch)


def _union_field(loc: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The location of the union-typed field when ``loc`` points into one of its branches."""
    for n in range(1, len(loc)):
        model = _model_at(loc[: n - 1])
        info = model.model_fields.get(loc[n - 1]) if model else None
        if info is not None and get_origin(info.annotation) in (Union, types.UnionType) and isinstance(loc[n], str):
            return loc[:n]
    return None


def _describe_error(err: Any, loc: tuple[Any, ...]) -> str:
    path = ".".join(str(p) for p in loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        names = list(parent.model_fields) if parent else []
        names += list(_aliases(parent)) if parent else []
        hint = did_you_mean(str(loc[-1]), names)
        if hint and len(loc) > 1:
            hint = hint.replace("'", "'" + ".".join(str(p) for p in loc[:-1]) + ".", 1)
        valid = f" valid keys: {', '.join(parent.model_fields)}" if parent and not hint else ""
        return f"unknown key '{path}'{hint}{valid}"
    if kind == "value_error":
        msg = str(err.get("ctx", {}).get("error", err["msg"]))
        return f"{path + ': ' if path else ''}{msg}"
    if kind == "literal_error":
        got = err.get("input")
        expected = re.findall(r"'([^']*)'", err.get("ctx", {}).get("expected", ""))
        hint = did_you_mean(str(got), expected) if isinstance(got, str) else ""
        return f"{path}: got {got!r}{hint or ';'} allowed: {', '.join(expected)}"
    if kind == "string_pattern_mismatch" and path == "run.device":
        return f"run.device: got {err.get('input')!r}; allowed: auto, cpu, cuda, cuda:N, mps"
    got = err.get("input")
    got_text = f" (got {got!r})" if not isinstance(got, (dict, list)) or len(repr(got)) < 60 else ""
    return f"{path}: {err['msg']}{got_text}"


def describe_fields(model: type[Section] = Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(path, default, aliases, description) for every leaf field, for ``ppokit config fields``."""
    rows = []
    for name, info in model.model_fields.items():
        sub = _section_type(info.annotation)
        if sub is not None:
            rows += describe_fields(sub, f"{prefix}{name}.")
            continue
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        rows.append((prefix + name, repr(info.default), ", ".join(extra.get("aliases", [])), info.description or ""))
    return rows
