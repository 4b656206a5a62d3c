"""Multi-turn PPO on text environments: the rollout source and the evaluator.

:class:`MultiTurnSource` is a :class:`~ppokit.components.RolloutSource`: the run loop, the scorer
and the learner train on what it collects unchanged. One iteration::

    episodes(iteration)     train.batch_size reset seeds from (seed, iteration, group), seat plans
    EpisodePlayer.play      one batched generate per turn and actor (ppokit.lm.multi_turn.episodes)
    finish(...)             failures, role baselines, trajectory_tensors (ppokit.lm.multi_turn.turn_batch),
                            extras["traj_group"] (E,); gigpo: extras["turn_state"] (E, K)

then the scorer gives old/reference log-probs and values, and
:func:`ppokit.lm.multi_turn.advantages.trajectory_advantages` applies ``algo.credit``, or without a
critic the group estimator over each group's trajectories of one seat (:func:`trajectory_groups`; a
group is ``algo.group_size`` episodes reset with one seed, with one seat plan).
``rollout.dynamic_sampling`` drops the groups whose returns are all equal and plays more
(:meth:`MultiTurnSource.finish_draw`). Self-play opponents come from the opponent pool
(:mod:`ppokit.lm.multi_turn.opponents`); :class:`TextEnvEvaluator` plays fixed seeds against each
evaluation opponent. Groups, self-play, role baselines and metrics: docs/multiturn.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ppokit.algo.dynamic_sampling import group_range, varied
from ppokit.components import Batch, RolloutQueue
from ppokit.config import Config
from ppokit.envs import CURRENT, OpponentPool, assign_seat, episode_metrics, make_env
from ppokit.envs.checks import check_failure_rate
from ppokit.errors import UserError
from ppokit.lm.multi_turn.episodes import TRUNCATION_REASONS, EpisodePlayer, PlayResult, Trajectory
from ppokit.lm.multi_turn.streams import StreamCodec
from ppokit.lm.multi_turn.turn_batch import trajectory_tensors, turn_states
from ppokit.lm.scoring import behaviour_log_probs
from ppokit.monitoring.stopping import EarlyStop
from ppokit.persistence.resume import own_random_stream, rollout_rngs

__all__ = ["MultiTurnSource", "TextEnvEvaluator", "engine_generate", "episode_seed", "make_envs", "seat_actors_of"]

EVAL_SEED_BASE = 10**15  # evaluation episodes use seeds EVAL_SEED_BASE + i: the same games every time


def episode_seed(seed: int, iteration: int, episode: int) -> int:
    """The reset seed of training episode ``episode`` of ``iteration``: a fixed function of the three."""
    return random.Random(f"ppokit-textenv:{seed}:{iteration}:{episode}").getrandbits(48)


def make_envs(spec: str, kwargs: dict[str, Any], n: int) -> list[Any]:
    """``n`` instances of the environment ``spec`` (built once, reset with a seed per episode)."""
    return [make_env(spec, **kwargs) for _ in range(n)]


def engine_generate(engine, opponents=None, opponent_engine=None) -> Callable:
    """The :class:`~ppokit.lm.multi_turn.episodes.EpisodePlayer`'s ``generate``: the current policy's engine for
    :data:`~ppokit.envs.CURRENT`, the opponent slot's (with the snapshot loaded) for a snapshot id.
    It returns each reply's tokens as sampled, its text and the engine's behaviour log-prob of
    each of its tokens (``RolloutBatch.rollout_log_prob``; None when the engine gives none:
    greedy generation)."""

    def generate(
        actor: str, prompts: list[list[int]], greedy: bool
    ) -> tuple[list[list[int]], list[str], list[list[float]] | None]:
        use = engine
        if actor != CURRENT:
            opponents.load(actor)
            use = opponent_engine
        batch = use.generate_ids(prompts, prompts=[""] * len(prompts), greedy=greedy)
        lengths = batch.mask.sum(1).long().tolist()
        ids = [row[:n] for row, n in zip(batch.responses.tolist(), lengths)]
        log_probs = None
        if batch.rollout_log_prob is not None:  # (n, R) float32, 0 after each reply's stop token
            log_probs = [row[:n] for row, n in zip(batch.rollout_log_prob.float().tolist(), lengths)]
        return ids, batch.texts, log_probs

    return generate


def player_for(
    cfg: Config, envs: Sequence[Any], codec: StreamCodec, generate: Callable, context: int | None, env_name: str
) -> EpisodePlayer:
    t = cfg.textenv
    return EpisodePlayer(
        envs,
        codec,
        generate,
        max_turns=t.max_turns,
        max_new_tokens=cfg.rollout.max_new_tokens,
        context=context,
        max_episode_tokens=t.max_episode_tokens,
        bootstrap=t.truncation == "bootstrap" and cfg.uses_critic,  # group estimators: no critic to ask
        failure_reward=t.failure_reward,
        env_name=env_name,
    )


class MultiTurnSource:
    """Episodes in, a multi-turn :class:`~ppokit.components.Batch` out (see the module docstring)."""

    steps_per_iteration = None

    def __init__(
        self,
        cfg: Config,
        player: EpisodePlayer,
        *,
        mode: str,
        pad_id: int,
        device,
        opponents=None,
        env_name: str = "the environment",
        engine=None,
        policy=None,
    ):
        self.cfg, self.player, self.mode, self.pad_id, self.device = cfg, player, mode, pad_id, device
        self.engine = engine  # the current policy's rollout engine (new weights go to it unless it shares them)
        self.policy = policy  # the learner's policy: the behaviour log-probs of episodes played ahead
        self.queue = RolloutQueue()  # iterations played ahead of their update (rollout.off_policy_steps)
        self.policy_version = 0  # the learner's version of the weights that play
        self.opponents = opponents  # AdapterSnapshots, with a pool
        self.env_name = env_name
        p = cfg.textenv.pool
        self.pool: OpponentPool | None = None
        if opponents is not None:
            self.pool = OpponentPool(
                sampling=p.sampling,
                latest_prob=p.latest_prob,
                current_prob=p.current_prob,
                capacity=p.capacity,
                seed=cfg.seed,
            )
            self._add_snapshot(pinned=True)
        self.updates = 0  # weight syncs with new weights (the run's first included)
        self.synced_version: int | None = None  # the learner's version at the last of them
        self.role_baseline: dict[str, float] = {}
        self.episodes_generated_total = 0  # rollout.dynamic_sampling: episodes played over the run
        self.draws: list[tuple[PlayResult, list[bool]]] = []  # and the iteration's draws so far, each kept group
        self.pool_sizes: dict[int, int] = {}  # iteration -> the pool's size when its opponents were drawn

    # ------------------------------------------------------------------ collect
    def collect(self, iteration: int) -> Batch:
        batch = self.queue.pop(iteration)
        return batch if batch is not None else self._collect(iteration)

    def prefetch(self, iteration: int) -> None:
        """``rollout.off_policy_steps`` = k: play ``iteration``'s episodes now, with the weights of
        this moment, for the update k iterations on (in this process nothing overlaps the update).
        Every rollout of a pipelined run is seeded from (seed, iteration) (:func:`rollout_rngs`), as
        a Ray worker seeds shard 0: one worker gives this run's batches."""
        if iteration not in self.queue:  # each iteration is played once, in order
            self.queue.put(iteration, self._collect(iteration))

    def _collect(self, iteration: int) -> Batch:
        # played ahead (rollout.off_policy_steps): seeded per iteration, as Ray workers seed shard 0
        seeded = (
            rollout_rngs(self.cfg.seed, iteration) if self.cfg.rollout.off_policy_steps else contextlib.nullcontext()
        )
        with seeded:
            return self._play_batch(iteration)

    def _play_batch(self, iteration: int) -> Batch:
        batch = None
        while batch is None:  # rollout.dynamic_sampling: too few groups whose returns vary yet
            seeds, plans = self.episodes(iteration, draw=self.draw)
            batch = self.finish_draw(iteration, self.player.play(seeds, seat_actors=seat_actors_of(plans)))
        batch.policy_version = self.policy_version
        if self.cfg.rollout.off_policy_steps and not self.cfg.algo.rollout_correction_bypass:
            # the weights that played it, in the scorer's numerics, before the updates move them
            # (bypass: the engine's rollout_log_prob serve)
            start = time.perf_counter()
            batch.tensors["old_log_prob"] = behaviour_log_probs(
                self.policy, batch.tensors, self.cfg.infer_micro_batch_size
            )
            batch.metrics["time_behaviour_log_prob"] = time.perf_counter() - start
        return batch

    @property
    def draw(self) -> int:
        """The index of the iteration's next draw of ``train.batch_size`` episodes (0: its first;
        only ``rollout.dynamic_sampling`` plays more than one)."""
        return len(self.draws)

    def finish_draw(self, iteration: int, result: PlayResult) -> Batch | None:
        """The batch of a draw of ``iteration``'s episodes (:meth:`episodes` with ``draw=``
        :attr:`draw`), played here or on Ray rollout workers (:mod:`ppokit.lm.multi_turn.shards`).
        Without ``rollout.dynamic_sampling``: :meth:`finish`. With it (DAPO's dynamic sampling, as
        single-turn runs filter prompt groups): None until the groups whose returns vary
        (:func:`groups_with_signal`) fill the batch, or ``max_gen_batches`` draws were played (the
        caller plays draw :attr:`draw` next); then the batch of the first ``batch_size / group_size``
        such groups in draw order, filled up at the limit with dropped groups in draw order."""
        if not self.cfg.rollout.dynamic_sampling.enable:
            return self.finish(iteration, result)
        ds, n, g = self.cfg.rollout.dynamic_sampling, self.cfg.train.batch_size, self.cfg.algo.group_size
        want = n // g
        self.draws.append((result, groups_with_signal(result.trajectories, g, want)))
        draws = self.draws
        kept = sum(sum(keep) for _, keep in draws)
        if kept < want and not (ds.max_gen_batches and len(draws) >= ds.max_gen_batches):
            return None
        self.draws = []  # the next iteration starts at draw 0
        chosen = [(d, j) for d, (_, keep) in enumerate(draws) for j in range(want) if keep[j]][:want]
        padded = [(d, j) for d, (_, keep) in enumerate(draws) for j in range(want) if not keep[j]]
        padded = padded[: want - len(chosen)]
        results = [r for r, _ in draws]
        batch = self.finish(iteration, select_groups(results, chosen + padded, g), played=n * len(draws))
        generated = [r for result in results for r in self._learner_records(result)]
        self.episodes_generated_total += n * len(draws)
        batch.metrics.update(
            {
                "dynamic_sampling/gen_batches": float(len(draws)),
                "dynamic_sampling/episodes_generated": float(n * len(draws)),
                "dynamic_sampling/episodes_generated_total": float(self.episodes_generated_total),
                "dynamic_sampling/kept_frac": kept / (want * len(draws)),
                "dynamic_sampling/padded_groups": float(len(padded)),
                "dynamic_sampling/return_mean_generated": sum(r.episode_return for r in generated)
                / max(len(generated), 1),
            }
        )
        return batch

    def episodes(self, iteration: int, draw: int = 0) -> tuple[list[int], list[dict]]:
        """The reset seed and the seat plan (:func:`seat_actors_of`) of every episode of ``iteration``,
        in episode order: in self-play, the learner's seat and the other seat's actor, drawn from
        the opponent pool here (Ray workers play a contiguous share of them,
        :mod:`ppokit.lm.multi_turn.shards`). Episodes ``j*G .. j*G + G - 1`` (``G`` =
        ``algo.group_size``) form group j: one reset seed :func:`episode_seed` ``(seed, iteration,
        j)``, one seat plan (the learner's seat, the other seat's actor drawn once). Draw ``d`` of an
        iteration (``rollout.dynamic_sampling``) plays the groups ``d * B/G + j`` (new seeds)."""
        n, g = self.cfg.train.batch_size, self.cfg.algo.group_size
        groups = n // g
        first = draw * groups  # the draw's first group
        seeds = [episode_seed(self.cfg.seed, iteration, first + i // g) for i in range(n)]  # a group: one seed
        seat_mode = self.cfg.textenv.seat
        if self.pool is not None:  # its size when the opponents were drawn (a Ray worker plays them later)
            self.pool_sizes[iteration] = len(self.pool)
        plans = []
        for j in range(groups):  # a group: one seat for the learner, one actor for the other seat
            learner = assign_seat(iteration * groups + j, mode=seat_mode, seed=self.cfg.seed)
            other = self.pool.sample() if self.pool is not None else CURRENT
            plans += [{learner: CURRENT, 1 - learner: other, "learner": learner} for _ in range(g)]
        return seeds, plans

    def finish(self, iteration: int, result: PlayResult, played: int | None = None) -> Batch:
        """The batch of the played episodes: failures checked, role baselines, tensors, metrics, samples.
        ``played``: the episodes played for it (``rollout.dynamic_sampling``: every draw's; default
        ``train.batch_size``), over which the failure and truncation rates are taken."""
        n = played or self.cfg.train.batch_size
        check_failure_rate(
            result.failures,
            n,
            max_rate=self.cfg.textenv.max_failure_rate,
            env_name=self.env_name,
            first_error=result.first_error,
        )
        learner = self._learner_records(result)
        shift = self._role_baselines(result.trajectories)
        tensors, extras = trajectory_tensors(
            result.trajectories, mode=self.mode, pad_id=self.pad_id, device=self.device
        )
        groups = trajectory_groups(result.trajectories, self.cfg.algo.group_size)
        extras["traj_group"] = groups.to(self.device)
        if self.cfg.algo.adv_estimator == "gigpo":  # each turn's state, for the step groups
            extras["turn_state"] = turn_states(result.trajectories, groups, self.mode).to(self.device)
        metrics = episode_metrics(learner)
        # the learner's mean episode return, under the name the progress line and `ppokit plot` read
        metrics["reward_mean"] = metrics.get("env/return_mean", 0.0)
        metrics.update(self._play_metrics(result, n))
        if self.cfg.algo.group_size > 1:
            metrics["env/uniform_group_rate"] = uniform_group_rate(result.trajectories, extras["traj_group"])
        if "turn_state" in extras:
            metrics["env/shared_state_rate"] = shared_state_rate(extras["turn_state"])
        metrics.update(
            rows=float(len(tensors["mask"])),
            trajectories=float(len(result.trajectories)),
            action_tokens=float(tensors["mask"].sum()),
            **shift,
        )
        if self.pool is not None:
            metrics.update(self._pool_metrics(result, iteration, n))
        return Batch(
            tensors=tensors,
            extras=extras,
            samples=trajectory_samples(result.trajectories, self.cfg.run.log_samples),
            metrics=metrics,
        )

    @staticmethod
    def _learner_records(result: PlayResult) -> list:
        """Each episode's record of the learner's seat (self-play: the seat assign_seat gave it)."""
        records = []
        for seat_records, actors in zip(result.records, result.actors):
            seat = actors.get("learner", next(iter(seat_records), None))
            if seat in seat_records:
                records.append(seat_records[seat])
        return records

    def _play_metrics(self, result: PlayResult, n: int) -> dict[str, float]:
        out = {
            "time_env": result.time_env,
            "time_generate": result.time_generate,
            "memory/peak_gb/generate": result.peak_gb_generate,
            "gen_tokens_per_s": result.generated_tokens / max(result.time_generate, 1e-9),
            "env/failures": float(result.failures),
            "env/reply_cut_rate": result.cut_replies / max(result.actions, 1),
        }
        for reason in TRUNCATION_REASONS:
            out[f"env/truncated_by_{reason}"] = result.truncations[reason] / n
        if self.opponents is not None:
            out["time_opponent_load"] = self.opponents.load_seconds
            self.opponents.load_seconds = 0.0
        return out

    def _role_baselines(self, trajectories: list[Trajectory]) -> dict[str, float]:
        tau = self.cfg.textenv.role_baseline_tau
        if not tau:
            return {}
        out = {}
        for traj in trajectories:
            key = str(traj.seat)
            baseline = self.role_baseline.get(key, 0.0)
            ret = traj.episode_return
            traj.turns[-1].reward -= baseline
            self.role_baseline[key] = (1 - tau) * baseline + tau * ret
        for key, value in self.role_baseline.items():
            out[f"role_baseline/seat{key}"] = value
        return out

    # ------------------------------------------------------------------ self-play pool
    def _pool_metrics(self, result: PlayResult, iteration: int, n: int) -> dict[str, float]:
        games = {"win": 0, "draw": 0, "loss": 0}
        current = 0
        for seat_records, actors in zip(result.records, result.actors):
            if "learner" not in actors:
                continue
            other = actors[1 - actors["learner"]]
            if other == CURRENT:
                current += 1
                continue
            outcome = seat_records[actors["learner"]].outcome if actors["learner"] in seat_records else None
            if outcome in games:
                games[outcome] += 1
                self.pool.record(other, outcome)
        total = sum(games.values())
        out = {
            "selfplay/pool_size": float(self.pool_sizes.pop(iteration, len(self.pool))),
            "selfplay/vs_current_episodes": float(current),
            "selfplay/vs_pool_episodes": float(total),
        }
        if total:
            out.update({f"selfplay/vs_pool_{k}_rate": v / total for k, v in games.items()})
        return out

    def _add_snapshot(self, pinned: bool = False) -> None:
        snapshot_id = f"update-{getattr(self, 'updates', 0)}"
        self.opponents.take(snapshot_id)
        for dropped in self.pool.add(snapshot_id, pinned=pinned, update=getattr(self, "updates", 0)):
            self.opponents.drop(dropped)

    def sync_weights(self, learner) -> None:
        """The learner's weights into an engine that holds its own copy (the HF engine shares the
        learner's policy); with a pool, a snapshot every ``snapshot_every`` updates."""
        if self.engine is not None and not self.engine.weights_shared:
            self.engine.load_weights(learner.rollout_weights())
        self.policy_version = learner.policy_version
        if self.synced_version == learner.policy_version:  # the same weights again: a resumed run's first sync
            return
        self.synced_version = learner.policy_version
        self.updates += 1
        every = self.cfg.textenv.pool.snapshot_every
        if self.pool is not None and every and self.updates % every == 0:
            self._add_snapshot()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "updates": self.updates,
            "synced_version": self.synced_version,
            "role_baseline": dict(self.role_baseline),
            "episodes_generated_total": self.episodes_generated_total,
        }
        queued = self.queue.state_dict()  # episodes played ahead of their update
        if queued is not None:
            state["pending"] = queued
        if self.pool is not None:
            state["pool"] = self.pool.state_dict()
            state["snapshots"] = self.opponents.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        self.updates = int(state["updates"])
        synced = state.get("synced_version")  # absent before: the resumed run's first sync counted again
        self.synced_version = None if synced is None else int(synced)
        self.role_baseline = {str(k): float(v) for k, v in state.get("role_baseline", {}).items()}
        self.episodes_generated_total = int(state.get("episodes_generated_total", 0))
        self.queue.load_state_dict(state.get("pending"))
        if self.pool is not None:
            self.pool.load_state_dict(state["pool"])
            self.opponents.load_state_dict(state["snapshots"])
        return []


def trajectory_groups(trajectories: Sequence[Trajectory], group_size: int) -> torch.Tensor:
    """(E,) long: the group of each trajectory, numbered 0.. in order of appearance. A group is
    one seat of the episodes that share a reset seed (episode ``// group_size``): in self-play
    each seat's trajectories are compared with the same seat's."""
    keys: dict[tuple[int, int | None], int] = {}
    ids = [keys.setdefault((t.episode // group_size, t.seat), len(keys)) for t in trajectories]
    return torch.tensor(ids, dtype=torch.long)


def uniform_group_rate(trajectories: Sequence[Trajectory], groups: torch.Tensor) -> float:
    """The fraction of groups whose trajectories all have the same return (a group estimator
    gives them advantage 0: no signal; a group of one counts as uniform)."""
    returns: dict[int, set[float]] = {}
    for traj, g in zip(trajectories, groups.tolist()):
        returns.setdefault(g, set()).add(traj.episode_return)
    return sum(len(r) == 1 for r in returns.values()) / max(len(returns), 1)


def shared_state_rate(turn_state: torch.Tensor) -> float:
    """The fraction of turns (``turn_state`` (E, K), -1: no turn) taken from a state that another
    trajectory of the group took a turn from too: the turns a GiGPO step advantage can be nonzero on."""
    taken = turn_state[turn_state >= 0]  # (turns,)
    if not taken.numel():
        return 0.0
    _, index, counts = torch.unique(taken, return_inverse=True, return_counts=True)
    return float((counts[index] > 1).float().mean())


def groups_with_signal(trajectories: Sequence[Trajectory], group_size: int, num_groups: int) -> list[bool]:
    """``keep`` per episode group (``num_groups`` of them): True when the returns of the trajectories
    of one of its seats vary (:func:`ppokit.algo.dynamic_sampling.group_range` and ``varied``:
    at least 2 trajectories, max > min), so that a group estimator gives them a nonzero advantage."""
    keep = [False] * num_groups
    if not trajectories:
        return keep
    returns = torch.tensor([t.episode_return for t in trajectories], dtype=torch.float64)  # (E,)
    lo, hi, count, index = group_range(returns, group_ids=trajectory_groups(trajectories, group_size))
    signal = varied(lo, hi, count)  # (groups of trajectories,)
    for traj, k in zip(trajectories, index.tolist()):
        keep[traj.episode // group_size] |= bool(signal[k])
    return keep


def select_groups(results: Sequence[PlayResult], picks: Sequence[tuple[int, int]], group_size: int) -> PlayResult:
    """One :class:`PlayResult` of the episode groups ``picks`` ((draw, group) pairs, in that order) of
    the draws ``results``, renumbered as episodes ``0 ..``; what the draws counted and measured
    (truncations, failures, times, tokens) summed over all of them."""
    trajectories, records, actors = [], [], []
    for k, (d, j) in enumerate(picks):
        r = results[d]
        for t in r.trajectories:
            if t.episode // group_size == j:
                trajectories.append(dataclasses.replace(t, episode=k * group_size + t.episode % group_size))
        records += r.records[j * group_size : (j + 1) * group_size]
        actors += r.actors[j * group_size : (j + 1) * group_size]
    return PlayResult(
        trajectories=trajectories,
        records=records,
        actors=actors,
        truncations={k: sum(r.truncations[k] for r in results) for k in TRUNCATION_REASONS},
        failures=sum(r.failures for r in results),
        first_error=next((r.first_error for r in results if r.first_error), None),
        time_generate=sum(r.time_generate for r in results),
        time_env=sum(r.time_env for r in results),
        peak_gb_generate=max(r.peak_gb_generate for r in results),
        generated_tokens=sum(r.generated_tokens for r in results),
        actions=sum(r.actions for r in results),
        cut_replies=sum(r.cut_replies for r in results),
    )


def seat_actors_of(plans: Sequence[dict]) -> Callable[[int, dict], dict]:
    """The :class:`EpisodePlayer`'s ``seat_actors`` for the seat plans of :meth:`MultiTurnSource.episodes`:
    episode i's plan in self-play (a two-player environment that plays no seat itself), else nothing."""

    def seat_actors(i: int, info: dict) -> dict:
        if "player" not in info or "seat" in info:  # one player, or the environment plays the other seat
            return {}
        return plans[i]

    return seat_actors


def trajectory_samples(trajectories: Sequence[Trajectory], k: int) -> list[dict[str, Any]]:
    """The first ``k`` trajectories as JSON rows for ``samples.jsonl``: the first observation,
    the turns (observation and action text, reward), the return, the outcome."""
    rows = []
    for traj in trajectories[:k]:
        record = traj.record
        rows.append(
            {
                "prompt": _text(traj.turns[0].observation),
                "seat": traj.seat,
                "turns": [
                    {"observation": _text(t.observation), "action": t.action_text, "reward": t.reward}
                    for t in traj.turns
                ],
                "reward": traj.episode_return,
                "outcome": record.outcome if record else None,
                "truncated": traj.truncated,
                "illegal_actions": record.illegal_actions if record else 0,
            }
        )
    return rows


def _text(observation: Any) -> Any:
    return observation if isinstance(observation, str) else [dict(m) for m in observation]


# ----------------------------------------------------------------------------- evaluation
class TextEnvEvaluator:
    """Episodes on fixed seeds: against each evaluation opponent, or the environment as trained.
    Periodic evaluations play the first opponent only (the one the stopping rule reads);
    the evaluations before and after training play them all. Replies are greedy, or
    (``textenv.eval_sampling: sampled``) sampled as the rollouts are, from a random stream
    seeded by the run's seed at every evaluation: the run's own stream, and with it every
    rollout, is the same either way, and every evaluation draws the same numbers.

    Metrics, with ``S`` = ``_before`` (before training), ``""`` (periodic) or ``_after``
    (after training) and ``O`` = ``/OPPONENT`` (or nothing): ``evalS/O/win_rate``,
    ``draw_rate``, ``loss_rate``, ``return_mean``, ``turns_mean``,
    ``illegal_action_rate``, ``truncated_rate``.
    """

    at_start = True
    releases_memory = True  # episodes' reference cycles held an evaluation's tensors (SmolLM2 on Nim-v0)

    def __init__(self, cfg: Config, generate: Callable, codec: StreamCodec, context: int | None, env_name: str):
        t = cfg.textenv
        self.every = t.eval_every
        self.episodes = t.eval_episodes
        self.greedy, self.seed, self.temperature = t.eval_sampling == "greedy", cfg.seed, cfg.rollout.temperature
        self.opponents = list(t.eval_opponents) or [None]
        self.players = {}
        for opponent in self.opponents:
            kwargs = dict(t.kwargs)
            if opponent is not None:
                kwargs["opponent"] = opponent
            envs = make_envs(t.env, kwargs, self.episodes)
            self.players[opponent] = player_for(cfg, envs, codec, generate, context, env_name)
        self.before: dict[str, float] = {}
        first = self.opponents[0]
        self.stop_key = "eval" + (f"/{first}" if first is not None else "") + "/win_rate"
        self.early_stop = EarlyStop(
            f"win rate vs {first}" if first is not None else "success rate",
            t.stop_at_win_rate,
            "textenv.stop_at_win_rate",
            cfg.train.eval_patience,
        )

    def evaluate(self, phase: str) -> dict[str, float]:
        suffix = {"before": "_before", "final": "_after"}.get(phase, "")
        out: dict[str, float] = {}
        for opponent, player in list(self.players.items())[: 1 if phase == "periodic" else None]:
            seeds = [EVAL_SEED_BASE + i for i in range(self.episodes)]
            result = self._play(player, seeds)
            records = [r for episode in result.records for r in episode.values()]
            metrics = episode_metrics(records, prefix="")
            where = f"eval{suffix}" + (f"/{opponent}" if opponent is not None else "")
            for key in (
                "win_rate",
                "draw_rate",
                "loss_rate",
                "return_mean",
                "turns_mean",
                "illegal_action_rate",
                "truncated_rate",
            ):
                out[f"{where}/{key}"] = metrics.get(key, 0.0)
        if phase == "before":
            self.before = dict(out)
        return out

    def _play(self, player: EpisodePlayer, seeds: list[int]) -> PlayResult:
        """The evaluation's episodes: greedy, or sampled on a random stream of their own."""
        if self.greedy:
            return player.play(seeds, seat_actors=lambda i, info: {}, greedy=True)
        with own_random_stream(self.seed):
            return player.play(seeds, seat_actors=lambda i, info: {}, greedy=False)

    def message(self, phase: str, metrics: dict[str, float]) -> str | None:
        suffix = {"before": "_before", "final": "_after"}.get(phase, "")
        label = {"before": "before PPO", "final": "after PPO"}.get(phase, "evaluation")
        parts = []
        for opponent in self.opponents:
            where = f"eval{suffix}" + (f"/{opponent}" if opponent is not None else "")
            if where + "/win_rate" not in metrics:  # a periodic evaluation: the first opponent only
                continue
            vs = f"vs {opponent}" if opponent is not None else "success"
            parts.append(
                f"{vs} {metrics[where + '/win_rate']:.1%} (draw {metrics[where + '/draw_rate']:.1%}, "
                f"illegal moves {metrics[where + '/illegal_action_rate']:.2%})"
            )
        how = "greedy" if self.greedy else f"sampled at temperature {self.temperature:g}"
        return f"{label}: " + "; ".join(parts) + f" ({self.episodes} episodes each, {how})"

    def stop_reason(self, metrics: dict[str, float]) -> str | None:
        return self.early_stop.update(metrics.get(self.stop_key))

    def state_dict(self) -> dict[str, Any]:
        return {"before": dict(self.before), "early_stop": self.early_stop.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.before = {str(k): float(v) for k, v in state.get("before", {}).items()}
        self.early_stop.load_state_dict(state.get("early_stop", {}))

    def close(self) -> None:
        pass


def check_env_output(env: Any, name: str) -> str:
    """The environment's observation mode, checked (``state`` or ``message``)."""
    mode = getattr(env, "observation_mode", "state")
    if mode not in ("state", "message"):
        raise UserError(
            f"environment '{name}' has observation_mode={mode!r}; it must be 'state' (each observation "
            "is the whole context) or 'message' (observations are appended to a conversation)"
        )
    return mode
