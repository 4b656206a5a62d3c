"""Advantages of multi-turn batches: credit over each trajectory's action tokens.

The multi-turn workload gives the run loop :func:`trajectory_advantages` in place of the
single-turn rule (:attr:`ppokit.components.Components.advantages`). The rows of one
trajectory (named by ``traj_index``, :mod:`ppokit.lm.multi_turn.turn_batch`) are one
sequence of turns:

- ``algo.adv_estimator: gae`` (with the critic): GAE by token or by turn
  (``algo.credit``, :func:`ppokit.algo.trajectory_credit`);
- a group estimator (``grpo``, ``rloo``, ``reinforce_pp_baseline``; no critic): each
  trajectory's return against the other trajectories of its group, the episodes of one
  environment seed and one seat (``extras["traj_group"]``, :mod:`ppokit.lm.multi_turn.source`),
  on every model token of the trajectory (:func:`ppokit.algo.trajectory_group_advantages`);
- ``gigpo``: grpo's episode advantage plus ``algo.step_advantage_weight`` times each turn's
  step advantage: its return from that turn (discounted by ``algo.gamma``) against the turns
  the group's other trajectories took from the same state (``extras["turn_state"]``,
  :func:`ppokit.algo.step_group_advantages`).
"""

from __future__ import annotations

from torch import Tensor

from ppokit import algo
from ppokit.components import Batch
from ppokit.config import Config


def trajectory_advantages(cfg: Config, batch: Batch) -> tuple[Tensor, Tensor]:
    """Multi-turn batches (:mod:`ppokit.lm.multi_turn.turn_batch`), (N, T) advantages and returns.

    With the critic (``gae``): ``algo.credit`` (token or turn GAE,
    :func:`ppokit.algo.trajectory_credit`) over each trajectory's action tokens, whose rows
    ``traj_index`` names; truncated trajectories bootstrap from ``extras["last_values"]``.
    With ``algo.normalize_adv`` the advantages are whitened over all action tokens of the
    batch at once, never per turn index (see :mod:`ppokit.algo.turns`).

    With a group estimator: :func:`ppokit.algo.trajectory_group_advantages` with the groups
    ``extras["traj_group"]`` (E,); like single-turn group estimators (verl), the advantages
    keep the normalisation the estimator defines (``algo.normalize_adv`` does not whiten them).
    """
    a, t = cfg.algo, batch.tensors
    truncated = batch.extras.get("traj_truncated")
    num_trajectories = None if truncated is None else truncated.shape[0]
    if not cfg.uses_critic:
        advantages = algo.trajectory_group_advantages(
            estimator=a.adv_estimator,
            rewards=t["rewards"],
            mask=t["mask"],
            traj_index=t["traj_index"],
            traj_group=batch.extras["traj_group"],
            num_trajectories=num_trajectories,
            norm_by_std=a.scale_rewards != "none",
            batch_std=a.scale_rewards == "batch",
            turn_index=t["turn_index"],
            turn_state=batch.extras.get("turn_state"),
            step_weight=a.step_advantage_weight,
            gamma=a.gamma,
        )
        return advantages
    advantages, returns = algo.trajectory_credit(
        credit=a.credit,
        rewards=t["rewards"],
        values=t["old_values"],
        mask=t["mask"],
        traj_index=t["traj_index"],
        turn_index=t.get("turn_index"),
        num_trajectories=num_trajectories,
        truncated=truncated,
        last_values=batch.extras.get("last_values"),
        gamma=a.gamma,
        lam=a.gae_lambda,
    )
    if a.normalize_adv:
        advantages = algo.whiten(advantages, t["mask"])
    return advantages, returns
