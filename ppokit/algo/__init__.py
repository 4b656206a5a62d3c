"""ppokit.algo: the PPO math as pure functions on torch tensors.

No models, environments, I/O or third-party ML frameworks: only ``torch`` and the
standard library. Shapes use B = batch rows (sequences / environments) and
T = time steps (tokens / env steps); masks are bool or 0/1 float (B, T).

Modules, one job each:

- :mod:`.registry`    name -> function registries with did-you-mean errors
- :mod:`.stats`       masked sum / mean / var, whiten, explained variance
- :mod:`.aggregation` per-token loss matrix -> scalar (token-mean, seq-mean-..., Dr. GRPO)
- :mod:`.advantages`  GAE, GRPO, RLOO, REINFORCE++ (+ baseline)
- :mod:`.policy_losses` PPO losses by name, one call for all (``PolicyLossInputs``): clip
  (asymmetric, dual clip) and adaptive KL penalty; token, sequence and GSPO-token ratios
- :mod:`.weighted_losses` a weight times the score: CISPO, DPPO (TV, KL), GPG, DRO
- :mod:`.surrogate_losses` ratio-surrogate variants: SAPO, GMPO (geo_mean), Clip-Cov, KL-Cov
- :mod:`.value_losses` clipped / Huber value loss
- :mod:`.kl`          per-token KL estimators, exact KL, mean sequence KL, KL-coefficient
  controllers (in-reward adaptive, PPO-penalty adaptive)
- :mod:`.kl_hidden`   exact KL over the vocabulary from hidden states, chunked (no full logits)
- :mod:`.logits`      chunked log-probs and entropy from logits
- :mod:`.hidden_log_probs` log-probs and entropy from hidden states, chunked (no full logits)
- :mod:`.turns`       multi-turn credit: turn layout, turn-level GAE, per-turn group advantages
- :mod:`.batching`    micro-batches by a token budget, sorted and balanced; padding fraction
- :mod:`.evaluation`  pass@k, estimated without bias from n samples
- :mod:`.dynamic_sampling` DAPO's filter: the groups whose rewards vary (std > 0, tested exactly)
- :mod:`.rollout_correction` the engine's sampling distribution against the trainer's: mismatch
  metrics, truncated / masked importance sampling (TIS, MIS) by name, verl's rejection rules
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_gae,
    gae_advantages,
    get_advantage_estimator,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from .aggregation import AGG_MODES, aggregate, aggregation_normalizer
from .batching import fixed_micro_batches, micro_batch_indices, padding_fraction, row_tokens, token_budget_micro_batches
from .dynamic_sampling import group_range, groups_with_variance
from .hidden_log_probs import log_probs_from_hidden
from .kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    AdaptivePenaltyCoef,
    FixedKLController,
    kl_full,
    kl_penalty,
    make_kl_controller,
    mean_sequence_kl,
)
from .kl_hidden import kl_full_from_hidden
from .logits import entropy_from_logits, log_probs_from_logits
from .policy_losses import (
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossInputs,
    get_policy_loss,
    policy_loss,
    ppo_penalty_loss,
    register_policy_loss,
)
from .registry import Registry, UnknownNameError
from .rollout_correction import (
    CORRECTION_LEVELS,
    REJECTION_RULES,
    ROLLOUT_CORRECTIONS,
    correction_ratio,
    mismatch_metrics,
    rejection_statistic,
    rollout_correction,
    rollout_rejection,
)
from .stats import explained_variance, masked_mean, masked_sum, masked_var, whiten
from .turns import (
    gather_turn_values,
    place_at_turn_ends,
    spread_over_turns,
    step_group_advantages,
    sum_turn_rewards,
    trajectory_credit,
    trajectory_group_advantages,
    turn_end_mask,
    turn_gae,
    turn_gae_advantages,
    turn_gae_rows,
    turn_group_advantages,
    turn_index_from_mask,
    turn_level_gae,
    turn_start_mask,
    turns_present,
)
from .value_losses import value_loss
from .weighted_losses import cispo_loss, dppo_loss, dro_loss, gpg_loss

# isort: split
# after weighted_losses: the registry lists the losses in this order (cispo .. dro, then sapo .. kl_cov)
from .surrogate_losses import clip_cov_loss, geo_mean_loss, kl_cov_loss, sapo_loss

__all__ = [
    "fixed_micro_batches",
    "micro_batch_indices",
    "row_tokens",
    "padding_fraction",
    "token_budget_micro_batches",
    # registry
    "Registry",
    "UnknownNameError",
    # stats
    "masked_sum",
    "masked_mean",
    "masked_var",
    "whiten",
    "explained_variance",
    # aggregation
    "AGG_MODES",
    "aggregate",
    "aggregation_normalizer",
    # advantages
    "ADVANTAGE_ESTIMATORS",
    "compute_gae",
    "get_advantage_estimator",
    "gae_advantages",
    "grpo_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    # dynamic sampling (DAPO)
    "group_range",
    "groups_with_variance",
    # losses
    "POLICY_LOSSES",
    "PolicyLoss",
    "PolicyLossInputs",
    "register_policy_loss",
    "get_policy_loss",
    "policy_loss",
    "ppo_penalty_loss",
    "cispo_loss",
    "dppo_loss",
    "gpg_loss",
    "dro_loss",
    "sapo_loss",
    "geo_mean_loss",
    "clip_cov_loss",
    "kl_cov_loss",
    "value_loss",
    # KL
    "KL_ESTIMATORS",
    "kl_penalty",
    "kl_full",
    "kl_full_from_hidden",
    "mean_sequence_kl",
    "FixedKLController",
    "AdaptiveKLController",
    "AdaptivePenaltyCoef",
    "make_kl_controller",
    # logits
    "log_probs_from_logits",
    "entropy_from_logits",
    # rollout correction
    "ROLLOUT_CORRECTIONS",
    "CORRECTION_LEVELS",
    "correction_ratio",
    "rollout_correction",
    "mismatch_metrics",
    "REJECTION_RULES",
    "rejection_statistic",
    "rollout_rejection",
    "log_probs_from_hidden",
    # multi-turn credit
    "turn_index_from_mask",
    "turn_start_mask",
    "turn_end_mask",
    "turns_present",
    "gather_turn_values",
    "sum_turn_rewards",
    "spread_over_turns",
    "place_at_turn_ends",
    "turn_gae",
    "turn_level_gae",
    "turn_gae_rows",
    "turn_gae_advantages",
    "turn_group_advantages",
    "trajectory_credit",
    "trajectory_group_advantages",
    "step_group_advantages",
]
