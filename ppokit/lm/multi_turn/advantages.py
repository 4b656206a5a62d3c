"""Advantages of multi-turn batches: credit over each trajectory's action tokens.

The multi-turn workload gives the run loop :func:`trajectory_advantages` in place of the
single-turn rule (:attr:`ppokit.components.Components.advantages`): the rows of one
trajectory (named by ``traj_index``, :mod:`ppokit.lm.multi_turn.turn_batch`) are one
sequence of turns for GAE by token or by turn (:func:`ppokit.algo.trajectory_credit`).
"""

from __future__ import annotations

from torch import Tensor

from ppokit import algo
from ppokit.components import Batch
from ppokit.config import Config


def trajectory_advantages(cfg: Config, batch: Batch) -> tuple[Tensor, Tensor]:
    """Multi-turn batches (:mod:`ppokit.lm.multi_turn.turn_batch`): ``algo.credit`` (token or turn GAE,
    :func:`ppokit.algo.trajectory_credit`) over each trajectory's action tokens, whose rows
    ``traj_index`` names; truncated trajectories bootstrap from ``extras["last_values"]``.
    With ``algo.normalize_adv`` the advantages are whitened over all action tokens of the
    batch at once, never per turn index (see :mod:`ppokit.algo.turns`)."""
    a, t = cfg.algo, batch.tensors
    truncated = batch.extras.get("traj_truncated")
    advantages, returns = algo.trajectory_credit(
        credit=a.credit,
        rewards=t["rewards"],
        values=t["old_values"],
        mask=t["mask"],
        traj_index=t["traj_index"],
        turn_index=t.get("turn_index"),
        num_trajectories=None if truncated is None else truncated.shape[0],
        truncated=truncated,
        last_values=batch.extras.get("last_values"),
        gamma=a.gamma,
        lam=a.gae_lambda,
    )
    if a.normalize_adv:
        advantages = algo.whiten(advantages, t["mask"])
    return advantages, returns
