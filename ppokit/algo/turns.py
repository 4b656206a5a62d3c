"""Credit assignment across the turns of multi-turn episodes (pure tensor math).

A multi-turn row of a (B, T) batch interleaves the model's action tokens with environment tokens
and padding; ``turn_index`` (B, T) is each action token's turn (-1 elsewhere), K the turn slots.

- Token level: :func:`~ppokit.algo.advantages.compute_gae` with ``mask = turn_index >= 0`` carries
  the next value and advantage across environment tokens. A turn's reward must sit on one of its
  action tokens (:func:`place_at_turn_ends`): a reward on a masked position is ignored.
- Turn level (turn-level PPO, as UnstableBaselines trains on text games): :func:`turn_level_gae` is
  :func:`gather_turn_values` (V at a turn's first action token), :func:`turn_gae` (GAE over turns)
  and :func:`spread_over_turns`; :func:`turn_gae_rows` when each turn is its own row.
- :func:`trajectory_credit`: either, where a trajectory spans rows. Critic-free, against a group:
  :func:`trajectory_group_advantages`, :func:`step_group_advantages`, :func:`turn_group_advantages`.

Never normalise per turn index: when the policy decides how long an episode lasts, per-index reward
baselines bias the gradient (``absent="zero"`` is the unbiased construction) and per-index whitening
reweights turns noisily. Whiten over all action tokens (:func:`~ppokit.algo.stats.whiten` with
``mask = turn_index >= 0``); why: docs/multiturn.md, "Why ppokit does not normalise per turn index".
"""

from __future__ import annotations

import torch

from .advantages import compute_gae, get_advantage_estimator

__all__ = [
    "gather_turn_values",
    "place_at_turn_ends",
    "spread_over_turns",
    "sum_turn_rewards",
    "turn_end_mask",
    "turn_gae",
    "turn_gae_advantages",
    "trajectory_credit",
    "trajectory_group_advantages",
    "turn_group_advantages",
    "turn_index_from_mask",
    "turn_gae_rows",
    "turn_level_gae",
    "turn_start_mask",
    "turns_present",
]


# ----------------------------------------------------------------------------- layout
def _check_turn_index(turn_index: torch.Tensor, num_turns: int | None = None) -> None:
    if not isinstance(turn_index, torch.Tensor) or turn_index.dim() != 2:
        shape = tuple(turn_index.shape) if isinstance(turn_index, torch.Tensor) else type(turn_index).__name__
        raise ValueError(f"turn_index must be a 2-D (B, T) tensor, got {shape}")
    if turn_index.dtype.is_floating_point or turn_index.dtype == torch.bool:
        raise ValueError(f"turn_index must be an integer tensor, got {turn_index.dtype}")
    if turn_index.numel():
        low, high = int(turn_index.min()), int(turn_index.max())
        if low < -1:
            raise ValueError(f"turn_index must be -1 (not an action token) or a turn number >= 0, found {low}")
        if num_turns is not None and high >= num_turns:
            raise ValueError(f"turn_index has turn {high} but the per-turn tensors have K = {num_turns} turn slots")


def turn_index_from_mask(action_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) turn numbers from an action mask: each maximal run of action tokens is a turn.

    ``turn_index[b, t] = (number of runs that start at or before t) - 1`` on action
    tokens, -1 elsewhere. Two turns must be separated by at least one non-action token
    (an observation, EOS or padding), which a multi-turn stream always has.
    """
    if action_mask.dim() != 2:
        raise ValueError(f"action_mask must be (B, T), got {tuple(action_mask.shape)}")
    m = action_mask if action_mask.dtype == torch.bool else action_mask != 0  # (B, T)
    prev = torch.nn.functional.pad(m[:, :-1], (1, 0), value=False)  # (B, T) mask at t-1
    starts = m & ~prev  # (B, T)
    index = torch.cumsum(starts.long(), dim=1) - 1  # (B, T)
    return torch.where(m, index, torch.full_like(index, -1))


def turn_start_mask(turn_index: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the first action token of each turn (where turn values are read)."""
    _check_turn_index(turn_index)
    prev = torch.nn.functional.pad(turn_index[:, :-1], (1, 0), value=-1)  # (B, T)
    return (turn_index >= 0) & (turn_index != prev)


def turn_end_mask(turn_index: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the last action token of each turn (where turn rewards go)."""
    _check_turn_index(turn_index)
    nxt = torch.nn.functional.pad(turn_index[:, 1:], (0, 1), value=-1)  # (B, T)
    return (turn_index >= 0) & (turn_index != nxt)


def turns_present(turn_index: torch.Tensor, num_turns: int) -> torch.Tensor:
    """(B, K) bool: turn k of row b has at least one action token."""
    _check_turn_index(turn_index, num_turns)
    B = turn_index.shape[0]
    present = torch.zeros(B, num_turns + 1, dtype=torch.bool, device=turn_index.device)  # slot K = "none"
    slot = torch.where(turn_index >= 0, turn_index, torch.full_like(turn_index, num_turns))
    present.scatter_(1, slot, True)
    return present[:, :num_turns]


def gather_turn_values(token_values: torch.Tensor, turn_index: torch.Tensor, num_turns: int) -> torch.Tensor:
    """(B, K) per-turn values: ``token_values`` at each turn's first action token (0 for absent turns)."""
    _check_turn_index(turn_index, num_turns)
    if token_values.shape != turn_index.shape:
        raise ValueError(
            f"token_values shape {tuple(token_values.shape)} != turn_index shape {tuple(turn_index.shape)}"
        )
    B = turn_index.shape[0]
    starts = turn_start_mask(turn_index)  # (B, T)
    slot = torch.where(starts, turn_index, torch.full_like(turn_index, num_turns))  # (B, T)
    out = token_values.new_zeros(B, num_turns + 1)
    out.scatter_(1, slot, torch.where(starts, token_values, torch.zeros_like(token_values)))
    return out[:, :num_turns]


def sum_turn_rewards(token_rewards: torch.Tensor, turn_index: torch.Tensor, num_turns: int) -> torch.Tensor:
    """(B, K) per-turn rewards: the sum of ``token_rewards`` over each turn's action tokens
    (a KL penalty per token adds up; rewards on non-action tokens are not counted)."""
    _check_turn_index(turn_index, num_turns)
    if token_rewards.shape != turn_index.shape:
        raise ValueError(
            f"token_rewards shape {tuple(token_rewards.shape)} != turn_index shape {tuple(turn_index.shape)}"
        )
    B = turn_index.shape[0]
    slot = torch.where(turn_index >= 0, turn_index, torch.full_like(turn_index, num_turns))  # (B, T)
    out = token_rewards.new_zeros(B, num_turns + 1)
    out.scatter_add_(1, slot, torch.where(turn_index >= 0, token_rewards, torch.zeros_like(token_rewards)))
    return out[:, :num_turns]


def spread_over_turns(per_turn: torch.Tensor, turn_index: torch.Tensor) -> torch.Tensor:
    """(B, T): ``per_turn[b, turn_index[b, t]]`` on action tokens, 0 elsewhere."""
    if per_turn.dim() != 2 or per_turn.shape[0] != turn_index.shape[0]:
        raise ValueError(
            f"per-turn tensor shape {tuple(per_turn.shape)} does not match turn_index rows {turn_index.shape[0]}"
        )
    _check_turn_index(turn_index, per_turn.shape[1])
    valid = turn_index >= 0  # (B, T)
    gathered = per_turn.gather(1, turn_index.clamp(min=0))  # (B, T)
    return torch.where(valid, gathered, torch.zeros_like(gathered))


def place_at_turn_ends(per_turn: torch.Tensor, turn_index: torch.Tensor) -> torch.Tensor:
    """(B, T) token rewards: each turn's reward on its last action token, 0 elsewhere
    (the input :func:`~ppokit.algo.advantages.compute_gae` needs for multi-turn rows)."""
    ends = turn_end_mask(turn_index)  # (B, T)
    spread = spread_over_turns(per_turn, turn_index)  # (B, T)
    return torch.where(ends, spread, torch.zeros_like(spread))


# ----------------------------------------------------------------------------- turn-level GAE
def turn_gae(
    turn_rewards: torch.Tensor,
    turn_values: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    turn_mask: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    last_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over turns: (B, K) advantages and lambda-returns.

    With ``V_k`` the value at turn k and the sums over the turns present in the row::

        delta_k = r_k + gamma * V_{k+1} - V_k
        A_k     = delta_k + gamma * lam * A_{k+1}
        R_k     = A_k + V_k

    After the row's last turn ``V_{k+1}`` is ``last_values[b]`` where ``truncated[b]``
    (the episode was cut short: bootstrap from the value of the state after the last
    turn) and 0 where it terminated. Turns with ``turn_mask == 0`` are skipped like
    masked tokens in :func:`~ppokit.algo.advantages.compute_gae` (A and R are 0 there).
    """
    if turn_rewards.shape != turn_values.shape:
        raise ValueError(
            f"turn_rewards shape {tuple(turn_rewards.shape)} != turn_values shape {tuple(turn_values.shape)}"
        )
    B = turn_rewards.shape[0]
    bootstrap = None
    if truncated is not None:
        truncated = torch.as_tensor(truncated, device=turn_rewards.device)
        if truncated.shape != (B,):
            raise ValueError(f"truncated shape {tuple(truncated.shape)} != (B,) = ({B},)")
        if last_values is None:
            if bool(truncated.any()):
                raise ValueError(
                    "truncated episodes need last_values (B,): the value of the state after the "
                    "last turn (pass 0 where the episode terminated)"
                )
        else:
            if last_values.shape != (B,):
                raise ValueError(f"last_values shape {tuple(last_values.shape)} != (B,) = ({B},)")
            bootstrap = torch.where(truncated.bool(), last_values, torch.zeros_like(last_values))
    elif last_values is not None:
        bootstrap = last_values
    return compute_gae(turn_rewards, turn_values, gamma=gamma, lam=lam, mask=turn_mask, last_values=bootstrap)


def turn_level_gae(
    *,
    turn_index: torch.Tensor,
    turn_values: torch.Tensor,
    turn_rewards: torch.Tensor | None = None,
    final_rewards: torch.Tensor | None = None,
    turn_mask: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
    last_values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level GAE spread onto the action tokens: (B, T) advantages and returns.

    - ``turn_index`` (B, T): the turn of each action token, -1 elsewhere.
    - ``turn_values`` (B, K): the value at each turn (:func:`gather_turn_values`).
    - ``turn_rewards`` (B, K) and/or ``final_rewards`` (B,): the reward of each turn;
      ``final_rewards[b]`` is added to row b's last present turn.
    - ``turn_mask`` (B, K): the turns present; default: the turns with action tokens.
      Every action token's turn must be present.
    - ``truncated`` (B,) bool and ``last_values`` (B,): see :func:`turn_gae`.

    Every action token of turn k gets ``A_k`` and ``R_k``; other tokens 0. The value
    loss then pulls every action token's value of turn k toward ``R_k``; to train the
    value only where it is read, mask it with :func:`turn_start_mask`. Whiten the result
    over all action tokens, not per turn index (see the module docstring).
    """
    B, K = turn_values.shape
    _check_turn_index(turn_index, K)
    if turn_index.shape[0] != B:
        raise ValueError(f"turn_index has {turn_index.shape[0]} rows but turn_values has {B}")
    present = turns_present(turn_index, K)  # (B, K)
    if turn_mask is None:
        turn_mask = present
    else:
        if turn_mask.shape != (B, K):
            raise ValueError(f"turn_mask shape {tuple(turn_mask.shape)} != turn_values shape {(B, K)}")
        turn_mask = turn_mask if turn_mask.dtype == torch.bool else turn_mask != 0
        if bool((present & ~turn_mask).any()):
            raise ValueError("turn_mask excludes a turn that has action tokens in turn_index")
    rewards = turn_values.new_zeros(B, K) if turn_rewards is None else turn_rewards.to(turn_values.dtype)
    if rewards.shape != (B, K):
        raise ValueError(f"turn_rewards shape {tuple(rewards.shape)} != turn_values shape {(B, K)}")
    if final_rewards is not None:
        if final_rewards.shape != (B,):
            raise ValueError(f"final_rewards shape {tuple(final_rewards.shape)} != (B,) = ({B},)")
        position = torch.arange(K, device=turn_mask.device).expand(B, K)  # (B, K)
        last = torch.where(turn_mask, position, torch.full_like(position, -1)).max(dim=1).values  # (B,)
        is_last = (position == last[:, None]) & turn_mask  # (B, K); no turn present: none
        rewards = rewards + torch.where(is_last, final_rewards.to(rewards.dtype)[:, None], rewards.new_zeros(()))
    adv, ret = turn_gae(
        rewards, turn_values, gamma=gamma, lam=lam, turn_mask=turn_mask, truncated=truncated, last_values=last_values
    )
    return spread_over_turns(adv, turn_index), spread_over_turns(ret, turn_index)


def turn_gae_rows(
    *,
    episode_index: torch.Tensor,
    turn_number: torch.Tensor,
    values: torch.Tensor,
    rewards: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    truncated: torch.Tensor | None = None,
    last_values: torch.Tensor | None = None,
    num_episodes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level GAE when every turn is its own row: (N,) advantages and returns, one per row.

    Row i is turn ``turn_number[i]`` of episode ``episode_index[i]`` (both (N,) ints,
    rows in any order, each (episode, turn) at most once); ``values`` (N,) is the value
    read at the row's first response token, ``rewards`` (N,) the turn's reward (the
    episode's final reward on its last turn). ``truncated`` / ``last_values`` are (E,)
    per episode, as in :func:`turn_gae`; E = ``num_episodes`` (default: max index + 1).
    The caller broadcasts each row's advantage over that row's response tokens.
    """
    for name, x in (
        ("episode_index", episode_index),
        ("turn_number", turn_number),
        ("values", values),
        ("rewards", rewards),
    ):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.shape != episode_index.shape:
            raise ValueError(
                f"{name} must be a 1-D (N,) tensor like episode_index, got "
                f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
            )
    for name, x in (("episode_index", episode_index), ("turn_number", turn_number)):
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
        if x.numel() and int(x.min()) < 0:
            raise ValueError(f"{name} must be >= 0")
    N = episode_index.shape[0]
    E = num_episodes if num_episodes is not None else (int(episode_index.max()) + 1 if N else 0)
    K = int(turn_number.max()) + 1 if N else 0
    if N and int(episode_index.max()) >= E:
        raise ValueError(f"episode_index has {int(episode_index.max())} but num_episodes is {E}")
    flat = episode_index * K + turn_number  # (N,) slot of each row in the (E, K) grid
    counts = torch.zeros(E * K, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    if N and int(counts.max()) > 1:
        raise ValueError("two rows have the same (episode_index, turn_number)")
    dtype = torch.promote_types(values.dtype, rewards.dtype)
    grid_values = values.new_zeros(E * K, dtype=dtype).index_copy_(0, flat, values.to(dtype)).view(E, K)
    grid_rewards = values.new_zeros(E * K, dtype=dtype).index_copy_(0, flat, rewards.to(dtype)).view(E, K)
    present = (counts > 0).view(E, K)  # (E, K)
    adv, ret = turn_gae(
        grid_rewards,
        grid_values,
        gamma=gamma,
        lam=lam,
        turn_mask=present,
        truncated=truncated,
        last_values=None if last_values is None else last_values.to(dtype),
    )
    return adv.reshape(-1)[flat], ret.reshape(-1)[flat]


def turn_gae_advantages(
    *,
    rewards: torch.Tensor,
    mask: torch.Tensor | None,
    values: torch.Tensor | None = None,
    turn_index: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    dones: torch.Tensor | None = None,
    last_values: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level GAE with the uniform estimator signature of
    :data:`~ppokit.algo.advantages.ADVANTAGE_ESTIMATORS` (one episode per row), ready to
    be registered as ``"turn_gae"``.

    Token inputs: ``rewards`` (B, T) summed per turn (:func:`sum_turn_rewards`),
    ``values`` (B, T) read at each turn's first action token
    (:func:`gather_turn_values`), ``turn_index`` (B, T) (default: the runs of ``mask``,
    :func:`turn_index_from_mask`), ``last_values`` (B,) the bootstrap after the last
    turn (0 where the episode terminated). Returns (B, T).
    """
    if values is None:
        raise ValueError("advantage estimator 'turn_gae' needs values (a critic)")
    if turn_index is None:
        if mask is None:
            raise ValueError(
                "advantage estimator 'turn_gae' needs turn_index (B, T) (the turn of each action "
                "token, -1 elsewhere) or a mask whose runs are the turns"
            )
        turn_index = turn_index_from_mask(mask)
    if dones is not None and bool((dones != 0).any()):
        raise ValueError("advantage estimator 'turn_gae' takes one episode per row; dones must be all 0 or None")
    if mask is not None:
        m = mask if mask.dtype == torch.bool else mask != 0
        if bool(((turn_index >= 0) & ~m).any()):
            raise ValueError("turn_index marks action tokens that the mask excludes")
    _check_turn_index(turn_index)
    K = int(turn_index.max()) + 1 if turn_index.numel() else 0
    K = max(K, 1)
    turn_rewards = sum_turn_rewards(rewards, turn_index, K)  # (B, K)
    turn_values = gather_turn_values(values.to(rewards.dtype), turn_index, K)  # (B, K)
    return turn_level_gae(
        turn_index=turn_index,
        turn_values=turn_values,
        turn_rewards=turn_rewards,
        last_values=last_values,
        gamma=gamma,
        lam=lam,
    )


# ----------------------------------------------------------------------------- trajectories over rows
CREDITS = ("token", "turn")


def _pack_action_tokens(
    mask: torch.Tensor, traj_index: torch.Tensor, num_trajectories: int | None
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every action token of an (N, T) batch in trajectory order, then time order:
    ``(E, rows, cols, traj, pos, counts)``. Token i sits at ``(rows[i], cols[i])`` (M,) in the
    batch and at ``(traj[i], pos[i])`` (M,) of an (E, L) grid of trajectories (L = the most
    action tokens of one trajectory); ``counts`` (E,) are each trajectory's action tokens.
    ``traj_index`` (N,) is checked (an integer per row, 0..E-1)."""
    N = mask.shape[0]
    traj_index = torch.as_tensor(traj_index, device=mask.device)
    if traj_index.shape != (N,) or traj_index.dtype.is_floating_point or traj_index.dtype == torch.bool:
        raise ValueError(
            f"traj_index must be an (N,) = ({N},) integer tensor, got {tuple(traj_index.shape)} {traj_index.dtype}"
        )
    if N and int(traj_index.min()) < 0:
        raise ValueError("traj_index must be >= 0")
    E = num_trajectories if num_trajectories is not None else (int(traj_index.max()) + 1 if N else 0)
    if N and int(traj_index.max()) >= E:
        raise ValueError(f"traj_index has {int(traj_index.max())} but num_trajectories is {E}")
    m = mask if mask.dtype == torch.bool else mask != 0  # (N, T)
    rows, cols = m.nonzero(as_tuple=True)  # (M,) each, row-major: time order within a row
    traj = traj_index[rows]  # (M,)
    order = torch.sort(traj, stable=True).indices  # group by trajectory, keep time order
    rows, cols, traj = rows[order], cols[order], traj[order]
    counts = torch.bincount(traj, minlength=E)  # (E,) action tokens per trajectory
    starts = torch.cumsum(counts, 0) - counts  # (E,)
    pos = torch.arange(traj.numel(), device=traj.device) - starts[traj]  # (M,) index within its trajectory
    return E, rows, cols, traj, pos, counts


def _trajectory_bootstrap(
    truncated: torch.Tensor | None, last_values: torch.Tensor | None, E: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """(E,) what each trajectory bootstraps from after its last action: ``last_values`` where
    ``truncated`` (all of them without ``truncated``), else 0; None without either."""
    if truncated is None and last_values is None:
        return None
    lv = torch.zeros(E, dtype=dtype, device=device) if last_values is None else last_values.to(dtype)
    if lv.shape != (E,):
        raise ValueError(f"last_values shape {tuple(lv.shape)} != (E,) = ({E},)")
    if truncated is None:
        return lv
    truncated = torch.as_tensor(truncated, device=device).bool()
    if truncated.shape != (E,):
        raise ValueError(f"truncated shape {tuple(truncated.shape)} != (E,) = ({E},)")
    if last_values is None and bool(truncated.any()):
        raise ValueError("truncated trajectories need last_values (E,): the value after the last action")
    return torch.where(truncated, lv, torch.zeros_like(lv))


def _token_credit(r_tok, v_tok, E, traj, pos, counts, bootstrap, gamma, lam) -> tuple[torch.Tensor, torch.Tensor]:
    """``credit="token"``: GAE over the (E, L) grid of each trajectory's action tokens in time order;
    the (M,) advantages and returns of the packed tokens (``r_tok``, ``v_tok`` (M,))."""
    L = int(counts.max()) if E else 0
    grid_r = r_tok.new_zeros(E, L).index_put_((traj, pos), r_tok)  # (E, L)
    grid_v = r_tok.new_zeros(E, L).index_put_((traj, pos), v_tok)  # (E, L)
    grid_m = torch.zeros(E, L, dtype=torch.bool, device=r_tok.device).index_put_(
        (traj, pos), torch.ones_like(pos, dtype=torch.bool)
    )  # (E, L)
    a_grid, r_grid = compute_gae(grid_r, grid_v, gamma=gamma, lam=lam, mask=grid_m, last_values=bootstrap)
    return a_grid[traj, pos], r_grid[traj, pos]


def _action_turns(turn_index, shape, rows, cols, traj) -> torch.Tensor:
    """(M,) the turn of each packed action token, checked: numbered, non-decreasing within a trajectory."""
    if turn_index is None:
        raise ValueError("credit='turn' needs turn_index (N, T): the turn number of each action token")
    if turn_index.shape != shape:
        raise ValueError(f"turn_index shape {tuple(turn_index.shape)} != rewards shape {tuple(shape)}")
    turn = turn_index[rows, cols].long()  # (M,)
    if bool((turn < 0).any()):
        raise ValueError("turn_index is -1 on a position where the mask is 1; number every action token's turn")
    if bool(((traj[1:] == traj[:-1]) & (turn[1:] < turn[:-1])).any()):
        raise ValueError("turn_index decreases within a trajectory; turns must be numbered in time order")
    return turn


def _turn_credit(r_tok, v_tok, E, traj, turn, bootstrap, gamma, lam) -> tuple[torch.Tensor, torch.Tensor]:
    """``credit="turn"``: per turn, the value at its first action token and the sum of its rewards;
    GAE over the (E, K) turns; the (M,) advantages and returns of the packed tokens, their turn's."""
    K = int(turn.max()) + 1 if turn.numel() else 1
    first = torch.ones_like(turn, dtype=torch.bool)  # (M,) first token of its turn
    first[1:] = ~((traj[1:] == traj[:-1]) & (turn[1:] == turn[:-1]))
    turn_values = r_tok.new_zeros(E, K).index_put_((traj[first], turn[first]), v_tok[first])  # (E, K)
    turn_rewards = r_tok.new_zeros(E, K).index_put_((traj, turn), r_tok, accumulate=True)  # (E, K)
    present = torch.zeros(E, K, dtype=torch.bool, device=r_tok.device).index_put_(
        (traj, turn), torch.ones_like(turn, dtype=torch.bool)
    )  # (E, K)
    a_turn, r_turn = compute_gae(turn_rewards, turn_values, gamma=gamma, lam=lam, mask=present, last_values=bootstrap)
    return a_turn[traj, turn], r_turn[traj, turn]


def trajectory_credit(
    *,
    credit: str,
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    traj_index: torch.Tensor,
    turn_index: torch.Tensor | None = None,
    num_trajectories: int | None = None,
    truncated: torch.Tensor | None = None,
    last_values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token- or turn-level GAE per trajectory, where trajectories span rows: (N, T) advantages and returns.

    - ``rewards``, ``values``, ``mask`` (N, T): rewards and values at every position,
      ``mask`` 1 on the model's (action) tokens. Only action tokens count: rewards and
      values elsewhere are ignored, and the results are 0 there.
    - ``traj_index`` (N,): the trajectory of each row, 0..E-1 (E = ``num_trajectories``,
      default max + 1). A trajectory's rows are in time order in the batch (other
      trajectories' rows may come between them) and each row's tokens in time order,
      so a trajectory's action tokens in (row, position) order are its actions in time.
    - ``turn_index`` (N, T): the turn number of each action token within its trajectory,
      non-decreasing in time order (-1 elsewhere). Needed for ``credit="turn"``.
    - ``truncated`` (E,) bool and ``last_values`` (E,): a truncated trajectory bootstraps
      from ``last_values`` after its last action; others end with 0.

    ``credit="token"``: :func:`~ppokit.algo.advantages.compute_gae` over each trajectory's
    action tokens in time order (environment tokens and row boundaries skipped): the
    last token of a turn bootstraps from the value at the first token of the next turn.

    ``credit="turn"``: per turn k, ``V_k`` = the value at its first action token and
    ``r_k`` = the sum of its tokens' rewards; :func:`turn_gae` over the turns; each
    turn's ``A_k`` and ``R_k`` on all of its action tokens.
    """
    if credit not in CREDITS:
        raise ValueError(f"credit must be one of {', '.join(CREDITS)}, got {credit!r}")
    if rewards.dim() != 2 or values.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(
            f"rewards, values and mask must be (N, T) alike, got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    E, rows, cols, traj, pos, counts = _pack_action_tokens(mask, traj_index, num_trajectories)
    bootstrap = _trajectory_bootstrap(truncated, last_values, E, dtype, rewards.device)
    r_tok = rewards.to(dtype)[rows, cols]  # (M,)
    v_tok = values.to(dtype)[rows, cols]  # (M,)
    if credit == "token":
        tok_adv, tok_ret = _token_credit(r_tok, v_tok, E, traj, pos, counts, bootstrap, gamma, lam)
    else:
        turn = _action_turns(turn_index, rewards.shape, rows, cols, traj)
        tok_adv, tok_ret = _turn_credit(r_tok, v_tok, E, traj, turn, bootstrap, gamma, lam)
    adv = torch.zeros(rewards.shape, dtype=dtype, device=rewards.device)  # (N, T)
    ret = torch.zeros_like(adv)
    adv[rows, cols] = tok_adv
    ret[rows, cols] = tok_ret
    return adv, ret


# ----------------------------------------------------------------------------- critic-free, per episode
# the estimators of ppokit.algo.advantages that take their baseline from a group of samples
# (ppokit.config.GROUP_ESTIMATORS names the same ones; tests/algo/test_algo_turns.py checks it)
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline", "gigpo")


def trajectory_group_advantages(
    *,
    estimator: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    traj_index: torch.Tensor,
    traj_group: torch.Tensor,
    num_trajectories: int | None = None,
    norm_by_std: bool = True,
    batch_std: bool = False,
    eps: float = 1e-6,
    turn_index: torch.Tensor | None = None,
    turn_state: torch.Tensor | None = None,
    step_weight: float = 1.0,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Critic-free outcome advantages of trajectories that span rows, against their group: (N, T) each.

    - ``rewards``, ``mask`` (N, T): ``mask`` 1 on the model's (action) tokens; rewards
      elsewhere are ignored.
    - ``traj_index`` (N,): the trajectory of each row, 0..E-1 (as :func:`trajectory_credit`).
    - ``traj_group`` (E,): an integer per trajectory; trajectories with equal ids form a group
      (the episodes started from the same environment seed, one seat).

    Each trajectory e is one sample of the group estimator ``estimator`` (one of
    :data:`GROUP_ESTIMATORS`, :mod:`ppokit.algo.advantages`), with the score
    ``s_e = sum of r over e's action tokens`` (its return, undiscounted), n_g trajectories
    in its group g::

        grpo                   A_e = (s_e - mean_g s) / (std_g s + eps)   (norm_by_std; else s_e - mean_g s;
                               with batch_std the std of all E scores in place of std_g)
        rloo                   A_e = s_e - (sum_g s - s_e) / (n_g - 1)
        reinforce_pp_baseline  A_e = s_e - mean_g s, then whitened over all action tokens of the batch

        gigpo                  A_e as grpo, plus step_weight * the step advantage of each turn
                               (:func:`step_group_advantages` with ``turn_index``, ``turn_state``, ``gamma``)

    (``std_g`` unbiased; a group of one gets 0.) ``A_e`` goes on every action token of e, in
    every row of it, and is 0 elsewhere: the outcome advantage at token level, as verl and
    SkyRL train agent episodes. ``returns = advantages`` (there is no critic to fit).
    Computed in the dtype of ``rewards``.
    """
    if estimator == "gigpo":
        if batch_std:
            raise ValueError("batch_std applies to grpo; gigpo's terms divide by their own groups' std")
        if turn_index is None or turn_state is None:
            raise ValueError("estimator='gigpo' needs turn_index (N, T) and turn_state (E, K)")
        batch = dict(rewards=rewards, mask=mask, traj_index=traj_index, norm_by_std=norm_by_std, eps=eps)
        episode, _ = trajectory_group_advantages(
            estimator="grpo", traj_group=traj_group, num_trajectories=num_trajectories, **batch
        )
        step = step_group_advantages(turn_index=turn_index, turn_state=turn_state, gamma=gamma, **batch)
        adv = episode + step_weight * step  # (N, T)
        return adv, adv.clone()
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"estimator must be a group estimator ({', '.join(GROUP_ESTIMATORS)}), got {estimator!r}")
    if rewards.dim() != 2 or mask.shape != rewards.shape:
        raise ValueError(f"rewards and mask must be (N, T) alike, got {tuple(rewards.shape)}, {tuple(mask.shape)}")
    E, rows, cols, traj, pos, counts = _pack_action_tokens(mask, traj_index, num_trajectories)
    traj_group = torch.as_tensor(traj_group, device=rewards.device)
    if traj_group.shape != (E,):
        raise ValueError(f"traj_group shape {tuple(traj_group.shape)} != (E,) = ({E},)")
    L = int(counts.max()) if E else 0
    grid_r = rewards.new_zeros(E, L).index_put_((traj, pos), rewards[rows, cols])  # (E, L)
    grid_m = torch.zeros(E, L, dtype=torch.bool, device=rewards.device).index_put_(
        (traj, pos), torch.ones_like(pos, dtype=torch.bool)
    )  # (E, L)
    fn = get_advantage_estimator(estimator)
    grid_a, _ = fn(
        rewards=grid_r, mask=grid_m, group_ids=traj_group, norm_by_std=norm_by_std, batch_std=batch_std, eps=eps
    )  # (E, L)
    adv = torch.zeros_like(rewards)  # (N, T)
    adv[rows, cols] = grid_a[traj, pos]
    return adv, adv.clone()


def step_group_advantages(
    *,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    traj_index: torch.Tensor,
    turn_index: torch.Tensor,
    turn_state: torch.Tensor,
    gamma: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GiGPO's step-level advantages (Feng et al., 2025, "Group-in-Group Policy Optimization for
    LLM Agent Training"; verl-agent's ``gigpo``): each turn against the turns taken from the same
    state in other trajectories of its group. (N, T), on action tokens, 0 elsewhere.

    - ``rewards``, ``mask`` (N, T), ``traj_index`` (N,) as :func:`trajectory_group_advantages`;
    - ``turn_index`` (N, T): the turn number of each action token, -1 elsewhere;
    - ``turn_state`` (E, K) integer: the anchor state of turn k of trajectory e (equal ids = the
      same state, seen by trajectories of the same group; the caller keys it on both), -1 where
      e has no turn k.

    With ``r_{e,k}`` the sum of turn k's rewards (on its action tokens) and
    ``Q_{e,k} = sum_{j >= k} gamma^(j-k) r_{e,j}`` (the discounted return from turn k), each
    anchor group S (the turns with one ``turn_state``, n_S of them)::

        A_{e,k} = (Q_{e,k} - mean_S Q) / (std_S Q + eps)    (norm_by_std; else Q_{e,k} - mean_S Q)

    (``std_S`` unbiased); a state seen once gets 0: no other action from it to compare with.
    ``A_{e,k}`` goes on every action token of turn k. Computed in the dtype of ``rewards``.
    """
    if rewards.dim() != 2 or mask.shape != rewards.shape or turn_index.shape != rewards.shape:
        raise ValueError(
            f"rewards, mask and turn_index must be (N, T) alike, got {tuple(rewards.shape)}, "
            f"{tuple(mask.shape)}, {tuple(turn_index.shape)}"
        )
    E, rows, cols, traj, _, _ = _pack_action_tokens(mask, traj_index, turn_state.shape[0])
    turn_state = torch.as_tensor(turn_state, device=rewards.device)
    K = turn_state.shape[1] if turn_state.dim() == 2 else -1
    if turn_state.shape != (E, K) or turn_state.dtype.is_floating_point:
        raise ValueError(f"turn_state must be an (E, K) integer tensor, got {tuple(turn_state.shape)}")
    turn = turn_index[rows, cols]  # (M,)
    if turn.numel() and (int(turn.min()) < 0 or int(turn.max()) >= K):
        raise ValueError(f"turn_index must be in 0..{K - 1} on every action token")
    if turn.numel() and bool((turn_state[traj, turn] < 0).any()):
        raise ValueError("turn_state is -1 at a turn that has action tokens")
    turn_r = rewards.new_zeros(E, K).index_put_((traj, turn), rewards[rows, cols], accumulate=True)  # (E, K)
    taken = turn_state >= 0  # (E, K)
    q = torch.zeros_like(turn_r)  # (E, K) discounted return from each turn
    running = rewards.new_zeros(E)
    for k in range(K - 1, -1, -1):
        running = torch.where(taken[:, k], turn_r[:, k] + gamma * running, running)
        q[:, k] = running
    # each anchor state a group of GRPO over its turns' returns (one sample a row)
    grpo = get_advantage_estimator("grpo")
    step_taken, _ = grpo(
        rewards=q[taken][:, None], mask=None, group_ids=turn_state[taken], norm_by_std=norm_by_std, eps=eps
    )
    step = torch.zeros_like(q).index_put_((taken.nonzero(as_tuple=True)), step_taken[:, 0])  # (E, K)
    adv = torch.zeros_like(rewards)  # (N, T)
    adv[rows, cols] = step[traj, turn]
    return adv


# ----------------------------------------------------------------------------- critic-free, per turn index
def turn_group_advantages(
    turn_rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    turn_mask: torch.Tensor | None = None,
    gamma: float = 1.0,
    absent: str = "zero",
    norm_by_std: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Critic-free per-turn advantages from group statistics per turn index: (B, K).

    Rows with equal ``group_ids`` (B,) are episodes of the same task. ``r_{b,k}`` is the
    reward of turn k, ``m_{b,k}`` whether row b took turn k (``turn_mask``, default all).

    ``absent="zero"`` (unbiased when the policy decides when to stop)::

        r~_{b,k} = r_{b,k} * m_{b,k}                    (a turn not taken counts as 0)
        mu_{g,k} = mean over all n_g rows of g of r~_{.,k}
        A_{b,t}  = sum_{k >= t} gamma^(k-t) (r~_{b,k} - mu_{g,k})

    so the baseline subtracted at turn t, ``sum_{k>=t} gamma^(k-t) mu_{g,k}``, is the same
    for every row of the group. Since ``r~_b - mean_g(r~) = (n_g-1)/n_g (r~_b - mean of the
    others)``, its expected gradient is (n_g-1)/n_g times the true policy gradient.

    ``absent="skip"`` (the MT-GRPO-style construction, biased; for comparison): the mean
    at turn k is over the rows that took turn k only, and the sum runs over the turns
    row b took, so the baseline depends on when row b stopped.

    ``norm_by_std`` divides each term by the std of its statistics set (+ ``eps``).
    Single-sample groups get 0. Entries for turns a row did not take are 0.
    """
    if turn_rewards.dim() != 2:
        raise ValueError(f"turn_rewards must be (B, K), got {tuple(turn_rewards.shape)}")
    if absent not in ("zero", "skip"):
        raise ValueError(f"absent must be 'zero' (unbiased) or 'skip' (MT-GRPO-style), got {absent!r}")
    B, K = turn_rewards.shape
    m = (
        torch.ones_like(turn_rewards, dtype=torch.bool)
        if turn_mask is None
        else (turn_mask if turn_mask.dtype == torch.bool else turn_mask != 0)
    )
    if m.shape != (B, K):
        raise ValueError(f"turn_mask shape {tuple(m.shape)} != turn_rewards shape {(B, K)}")
    group_ids = torch.as_tensor(group_ids, device=turn_rewards.device)
    if group_ids.shape != (B,):
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} != (B,) = ({B},)")
    _, index = torch.unique(group_ids, return_inverse=True)  # (B,)
    G = int(index.max()) + 1 if B else 0
    zero = turn_rewards.new_zeros(())
    r = torch.where(m, turn_rewards, zero)  # (B, K)
    members = torch.ones_like(r) if absent == "zero" else m.to(r.dtype)  # (B, K) rows in each (g, k) statistic
    count = r.new_zeros(G, K).index_add(0, index, members)  # (G, K)
    mean = r.new_zeros(G, K).index_add(0, index, r * members) / count.clamp(min=1)  # (G, K)
    centered = (r - mean[index]) * members  # (B, K)
    if norm_by_std:
        var = r.new_zeros(G, K).index_add(0, index, centered**2) / (count - 1).clamp(min=1)  # (G, K)
        centered = centered / (var.sqrt()[index] + eps)
    centered = torch.where(count[index] > 1, centered, zero)  # single-member statistics: no signal
    # reward-to-go of the centred terms: A_t = c_t + gamma * A_{t+1}
    adv = torch.zeros_like(centered)
    running = r.new_zeros(B)
    for k in range(K - 1, -1, -1):
        running = centered[:, k] + gamma * running
        adv[:, k] = running
    return torch.where(m, adv, zero)
