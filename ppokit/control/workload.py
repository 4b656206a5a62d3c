"""The control workload: the components of PPO on a Gymnasium environment.

One iteration, as the run loop (:mod:`ppokit.loop`) drives it::

    batch = ControlSource.collect()        # (E, S) tensors from E envs x S steps (rollout.py)
    advantages: GAE over each env's steps, through episode ends (ppokit.trainer)
    ControlLearner.update(batch)           # flattened to N = E*S samples of T = 1: the mini-batches
                                           # shuffle transitions; ppokit.trainer's epochs
    ControlEvaluator                       # deterministic returns, periodic and final (evaluate.py)

Speed on a CPU: one torch thread (unless ``run.torch_threads``), numpy/torch buffers that
share memory, one forward pass and one ``env.step`` per step for all envs. The control
workload always runs on the CPU: its MLPs are too small for an accelerator to pay off.
Exact resume: the checkpoint holds the weights, the optimizer, the envs mid-episode (see
envstate.py) and the normalization statistics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppokit.components import CONTROL_INPUTS, UPDATE_KEYS, Batch, Components, RolloutQueue
from ppokit.config import Config
from ppokit.control.envs import VecEnv
from ppokit.control.evaluate import Evaluator, evaluate_policy
from ppokit.control.networks import ActorCritic
from ppokit.control.rollout import Rollout
from ppokit.control.vector_env import check_environment, make_vector_env
from ppokit.monitoring.stopping import EarlyStop
from ppokit.persistence.resume import all_finite, rollout_rngs, seed_globals
from ppokit.trainer import DataParallel, PPOTrainer

# The per-sample tensors of the update (N = E*S transitions, each a sequence of T = 1 step).
CONTROL_UPDATE_KEYS = (*CONTROL_INPUTS, *UPDATE_KEYS)


class ControlSource:
    """E vector envs stepped by the policy: ``collect() -> Batch`` of (E, S) tensors.

    Also a rollout worker's source (:class:`ppokit.components.ShardSource`): a shard of
    the envs and a copy of the policy that :meth:`load_rollout_weights` updates.
    """

    def __init__(self, venv: VecEnv, policy: ActorCritic, num_steps: int, *, seed: int = 0, off_policy_steps: int = 0):
        self.venv, self.policy = venv, policy
        self.rollout = Rollout(venv, num_steps)
        self.steps_per_iteration = venv.num_envs * num_steps
        self._finished_before = venv.episodes_finished
        self.seed, self.off_policy_steps = seed, off_policy_steps
        self.policy_version = 0  # the learner's version of the policy's weights
        self.queue = RolloutQueue()  # iterations collected ahead (rollout.off_policy_steps)

    def collect(self, iteration: int) -> Batch:
        batch = self.queue.pop(iteration)
        return batch if batch is not None else self._collect(iteration)

    def prefetch(self, iteration: int) -> None:
        """Collect ``iteration`` now, unless it is queued (in this process nothing overlaps
        with the update)."""
        if iteration not in self.queue:
            self.queue.put(iteration, self._collect(iteration))

    def _collect(self, iteration: int) -> Batch:
        if self.off_policy_steps:  # seeded per iteration: the same on a Ray worker
            with rollout_rngs(self.seed, iteration):
                return self.collect_shard(iteration, None)
        return self.collect_shard(iteration, None)

    def collect_shard(self, iteration: int, request: Any = None) -> Batch:
        """The envs' next ``num_steps`` steps under the current RNG state."""
        data = self.rollout.collect(self.policy)
        venv = self.venv
        metrics: dict[str, float] = {"episodes": venv.episodes_finished - self._finished_before}
        self._finished_before = venv.episodes_finished
        if venv.episode_returns:
            metrics.update(
                return_mean=float(np.mean(venv.episode_returns)),
                return_std=float(np.std(venv.episode_returns)),
                episode_length=float(np.mean(venv.episode_lengths)),
            )
        tensors = {
            "obs": data["obs"],
            "actions": data["actions"],
            "mask": data["mask"],
            "old_log_prob": data["log_probs"],
            "old_values": data["values"],
            "rewards": data["rewards"],
            "dones": data["dones"],
        }
        return Batch(
            tensors=tensors,
            extras={"last_values": data["last_values"]},
            metrics=metrics,
            policy_version=self.policy_version,
        )

    def sync_weights(self, learner: ControlLearner) -> None:
        """Nothing to copy: the rollout runs the learner's own network."""
        self.policy_version = learner.policy_version

    def load_rollout_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """All of the actor-critic's tensors, or one bucket of them."""
        self.policy.load_named_state({**self.policy.named_state(), **weights})

    def state_dict(self) -> dict[str, Any]:
        state = {
            "venv": self.venv.state_dict(),
            "normalizer": self.venv.normalizer.state_dict(),
            "rollout": {"started": self.rollout.started, "last_obs": self.rollout.obs[-1].copy()},
        }
        queued = self.queue.state_dict()
        if queued is not None:
            state["pending"] = queued
        return state

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        self.queue.load_state_dict(state.get("pending"))
        if "shards" in state:  # stepped by several rollout workers: another env layout
            [state], notes = regroup_env_states(state, 1)
            return self._restart(state) + notes
        if state.get("restart"):
            return self._restart(state)
        self.venv.normalizer.load_state_dict(state["normalizer"])
        exact = self.venv.load_state_dict(state["venv"])
        self._finished_before = self.venv.episodes_finished
        if exact:
            self.rollout.continue_from(state["rollout"]["last_obs"] if state["rollout"]["started"] else None)
            return []
        # AsyncVectorEnv: the episodes in flight cannot be captured; start new ones.
        cfg = self.venv.cfg
        self.rollout.continue_from(self.venv.reset(seed=self.venv.seed + 100_003 * self.venv.episodes_finished))
        return [
            f"note: env.vectorization={cfg.vectorization} ({type(self.venv.env).__name__}) cannot be "
            "snapshotted: the episodes in flight restart, so the resumed run is not bit-identical"
        ]

    def _restart(self, state: dict[str, Any]) -> list[str]:
        """New episodes under the checkpoint's normalisation statistics and episode record
        (a :func:`regroup_env_states` state)."""
        venv = self.venv
        venv.normalizer.load_state_dict(state["normalizer"])
        venv.episode_returns.extend(np.asarray(state["episode_returns"], np.float64).tolist())
        venv.episode_lengths.extend(np.asarray(state["episode_lengths"], np.int64).tolist())
        venv.episodes_finished = self._finished_before = int(state["episodes_finished"])
        self.rollout.continue_from(venv.reset(seed=venv.seed + 100_003 * int(state["reset_offset"])))
        return []


def env_shards(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The env states of a control source checkpoint, one per shard that stepped them
    (one: in-process, or one rollout worker)."""
    return state.get("shards", [state])


def regroup_env_states(state: dict[str, Any], num_shards: int) -> tuple[list[dict[str, Any]], list[str]]:
    """A control source checkpoint for ``num_shards`` shards of the envs; (their states, notes).

    The same number of shards: the states as they are (exact). Another number: the
    Gymnasium vector env's state (one RNG for all its envs) cannot be split or joined, so
    every shard starts new episodes ("restart" states) with the merged normalisation
    statistics, each shard counting 1/num_shards of their samples (merging the shards
    again gives the checkpoint's statistics); the episode record goes to shard 0.
    """
    shards = env_shards(state)
    if len(shards) == num_shards:
        return [dict(s) for s in shards], []
    normalizer = merged_normalizer_state([s["normalizer"] for s in shards])
    for key in ("obs_count", "ret_count"):
        normalizer[key] = normalizer[key] / num_shards
    venvs = [s["venv"] for s in shards if "venv" in s]
    finished = sum(int(v["episodes_finished"]) for v in venvs) + sum(
        int(s.get("episodes_finished", 0)) for s in shards if "venv" not in s
    )
    returns = np.concatenate(
        [np.asarray(s["venv"]["episode_returns"] if "venv" in s else s["episode_returns"], np.float64) for s in shards]
    )
    lengths = np.concatenate(
        [np.asarray(s["venv"]["episode_lengths"] if "venv" in s else s["episode_lengths"], np.int64) for s in shards]
    )
    offset = max(finished, 1)
    out = [
        {
            "restart": True,
            "normalizer": dict(normalizer),
            "reset_offset": offset,
            "episodes_finished": finished if i == 0 else 0,
            "episode_returns": returns if i == 0 else np.zeros(0, np.float64),
            "episode_lengths": lengths if i == 0 else np.zeros(0, np.int64),
        }
        for i in range(num_shards)
    ]
    note = (
        f"note: the checkpoint's envs were stepped in {len(shards)} shard(s) and this run steps them in "
        f"{num_shards} (cluster.rollout_workers): the episodes in flight restart with the merged "
        "normalisation statistics, so the resumed run is not bit-identical"
    )
    return out, [note]


class ControlShardPlan:
    """The driver's side of N rollout workers, each stepping ``num_envs / N`` of the envs
    (shard s: envs ``s*E/N ..``, seeded as those envs are in-process). Each worker keeps
    its own normalisation statistics; the driver's copy (evaluation, checkpoints) is their
    merge (one worker: its statistics as they are)."""

    def __init__(self, venv: VecEnv, num_steps: int, num_shards: int):
        self.venv, self.num_shards = venv, num_shards
        self.steps_per_iteration = venv.num_envs * num_steps

    def requests(self, iteration: int) -> list[Any]:
        return [None] * self.num_shards

    def sync_weights(self, learner) -> None:
        """Nothing of the driver's own to update."""

    def merge(self, iteration: int, parts: list[Batch], states: list[dict[str, Any]]) -> Batch:
        self._merge_normalizers([s["normalizer"] for s in states])
        if len(parts) == 1:
            return parts[0]
        tensors = {k: torch.cat([p.tensors[k] for p in parts]) for k in parts[0].tensors}  # (E, S, ...)
        extras = {k: torch.cat([p.extras[k] for p in parts]) for k in parts[0].extras}
        metrics: dict[str, float] = {"episodes": sum(p.metrics["episodes"] for p in parts)}
        returns = np.concatenate([np.asarray(s["venv"]["episode_returns"], np.float64) for s in states])
        lengths = np.concatenate([np.asarray(s["venv"]["episode_lengths"], np.float64) for s in states])
        if returns.size:
            metrics.update(
                return_mean=float(np.mean(returns)),
                return_std=float(np.std(returns)),
                episode_length=float(np.mean(lengths)),
            )
        return Batch(tensors=tensors, extras=extras, metrics=metrics, policy_version=parts[0].policy_version)

    def _merge_normalizers(self, states: list[dict[str, Any]]) -> None:
        self.venv.normalizer.load_state_dict(merged_normalizer_state(states))

    def state_dict(self, shard_states: list[dict[str, Any]]) -> dict[str, Any]:
        return shard_states[0] if len(shard_states) == 1 else {"shards": shard_states}

    def load_state_dict(self, state: dict[str, Any]) -> tuple[list[dict[str, Any] | None], list[str]]:
        shards, notes = regroup_env_states(state, self.num_shards)
        self._merge_normalizers([s["normalizer"] for s in shards])
        return shards, notes


def merged_normalizer_state(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One :class:`~ppokit.control.envs.Normalizer` state from the shards' (one: as it is)."""
    if len(states) == 1:
        return dict(states[0])
    merged = {}
    for prefix in ("obs_", "ret_"):
        stats = [{k[len(prefix) :]: v for k, v in s.items() if k.startswith(prefix)} for s in states]
        merged.update({prefix + k: v for k, v in merge_running_stats(stats).items()})
    return merged


def merge_running_stats(stats: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Mean, variance and count of the union of streams summarised by ``stats`` (Chan et al.)."""
    mean = np.asarray(stats[0]["mean"], np.float64)
    var = np.asarray(stats[0]["var"], np.float64)
    count = float(np.asarray(stats[0]["count"]).reshape(-1)[0])
    for s in stats[1:]:
        m, v = np.asarray(s["mean"], np.float64), np.asarray(s["var"], np.float64)
        n = float(np.asarray(s["count"]).reshape(-1)[0])
        total = count + n
        delta = m - mean
        mean = mean + delta * (n / total)
        var = (var * count + v * n + delta**2 * (count * n / total)) / total
        count = total
    return {"mean": mean, "var": var, "count": np.array(count, np.float64)}


class ControlLearner:
    """The actor-critic and the shared PPO update over the flattened transitions."""

    reads_shards = False  # a checkpoint's tensors come whole from the run loop

    def __init__(self, cfg: Config, policy: ActorCritic, parallel: DataParallel | None = None):
        self.policy = policy
        self.trainer = PPOTrainer(cfg, policy, total_iterations=cfg.iterations, parallel=parallel)
        self.policy_version = 0

    def update(self, batch: Batch, iteration: int) -> dict[str, float]:
        n = batch.tensors["mask"].numel()  # E * S transitions
        flat = {k: v.reshape(n, 1, *v.shape[2:]) for k, v in batch.tensors.items() if k in CONTROL_UPDATE_KEYS}
        metrics = self.trainer.update(flat, iteration)
        self.policy_version += 1
        return metrics

    def rollout_weights(self) -> dict[str, torch.Tensor]:
        """The whole actor-critic: the rollout computes values too."""
        return self.policy.named_state()

    def trained_weights(self) -> dict[str, torch.Tensor]:
        return self.policy.named_state()

    def load_trained_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """All of the actor-critic's tensors, or one bucket of them."""
        self.policy.load_named_state({**self.policy.named_state(), **weights})

    def weights_finite(self) -> bool:
        return all_finite(self.policy.named_state().values())

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.policy.named_state(),
            "trainer": self.trainer.state_dict(),
            "policy_version": self.policy_version,
        }

    def save_files(self, directory: Path) -> None:
        """Nothing beside the state: the weights are in it (``ppokit eval`` reads them there)."""

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        self.policy.load_named_state(state["model"])
        self.trainer.load_state_dict(state["trainer"])
        self.policy_version = int(state.get("policy_version", 0))


class ControlEvaluator:
    """Deterministic returns: every ``env.eval_every`` iterations in a vector env of its own
    (``periodic_eval_return_mean``; ``env.stop_at_return`` ends training once reached), and
    over ``env.eval_episodes`` fresh episodes at the end (``eval_return_mean``)."""

    at_start = False
    releases_memory = False  # small networks: the collection would cost more than it frees

    def __init__(self, cfg: Config, policy: ActorCritic, venv: VecEnv):
        e = cfg.env
        self.cfg, self.policy, self.venv = cfg, policy, venv
        self.every = e.eval_every
        self.periodic = Evaluator(cfg, e.eval_episodes) if e.eval_every else None
        self.early_stop = EarlyStop(
            "periodic eval return", e.stop_at_return, "env.stop_at_return", cfg.train.eval_patience, fmt="{:.1f}"
        )

    def evaluate(self, phase: str) -> dict[str, float]:
        normalizer = self.venv.normalizer.state_dict()
        if phase == "final":
            mean, std = evaluate_policy(self.cfg, self.policy, normalizer, self.cfg.env.eval_episodes)
            return {"eval_return_mean": mean, "eval_return_std": std}
        returns = self.periodic.run(self.policy, normalizer)
        return {"periodic_eval_return_mean": float(returns.mean()), "periodic_eval_return_std": float(returns.std())}

    def message(self, phase: str, metrics: dict[str, float]) -> str | None:
        return None

    def stop_reason(self, metrics: dict[str, float]) -> str | None:
        return self.early_stop.update(metrics.get("periodic_eval_return_mean"))

    def state_dict(self) -> dict[str, Any]:
        state = {"early_stop": self.early_stop.state_dict()}
        return state | ({"venv": self.periodic.venv.state_dict()} if self.periodic is not None else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.early_stop.load_state_dict(state.get("early_stop", {}))
        if self.periodic is not None and "venv" in state:
            self.periodic.venv.load_state_dict(state["venv"])

    def close(self) -> None:
        if self.periodic is not None:
            self.periodic.close()


class ControlWorkload:
    """Builds the components of a control run (:class:`ppokit.components.Workload`)."""

    name = "control"

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def check_inputs(self) -> None:
        """The errors a run would hit (unknown id, unsupported spaces, bad arguments) before a run directory exists."""
        check_environment(self.cfg.env)

    def check_checkpoint(self, meta: dict[str, Any], path: Path) -> None:
        """Nothing beyond the loop's checks: the config equality covers the env and the network."""

    def shard_plan(self, components: Components, num_shards: int) -> ControlShardPlan:
        return ControlShardPlan(components.source.venv, self.cfg.env.num_steps, num_shards)

    def rollout_shard(self, shard: int, num_shards: int) -> ControlSource:
        """Envs ``shard*E/N ..`` of the run's E, seeded as in-process, and a policy copy."""
        cfg, e = self.cfg, self.cfg.env
        _set_up_process(cfg)
        n = e.num_envs // num_shards
        venv = VecEnv(e, n, seed=cfg.seed + shard * n, gamma=cfg.algo.gamma, training=True)
        policy = ActorCritic(venv.obs_dim, venv.action_dim, venv.discrete, cfg.network)
        return ControlSource(venv, policy, e.num_steps, seed=cfg.seed, off_policy_steps=cfg.rollout.off_policy_steps)

    def learner_replica(self, parallel: DataParallel) -> ControlLearner:
        cfg = self.cfg
        _set_up_process(cfg)
        venv = make_vector_env(cfg.env, 1)
        try:
            obs_dim = int(venv.single_observation_space.shape[0])
            space = venv.single_action_space
            discrete = hasattr(space, "n")
            action_dim = int(space.n) if discrete else int(space.shape[0])
        finally:
            venv.close()
        return ControlLearner(cfg, ActorCritic(obs_dim, action_dim, discrete, cfg.network), parallel)

    def build(self, run_dir: Path) -> Components:
        cfg, e = self.cfg, self.cfg.env
        _set_up_process(cfg)  # network init, then action sampling
        venv = VecEnv(e, e.num_envs, seed=cfg.seed, gamma=cfg.algo.gamma, training=True)
        try:
            policy = ActorCritic(venv.obs_dim, venv.action_dim, venv.discrete, cfg.network)
            learner = ControlLearner(cfg, policy)
            source = ControlSource(
                venv, policy, e.num_steps, seed=cfg.seed, off_policy_steps=cfg.rollout.off_policy_steps
            )
            evaluator = ControlEvaluator(cfg, policy, venv) if e.eval_episodes else None
        except BaseException:
            venv.close()
            raise
        header = []
        if cfg.run.device not in ("auto", "cpu"):
            header.append(f"note: the control workload runs on the CPU (run.device={cfg.run.device} ignored)")
        meta = {"env_id": e.id, "obs_dim": venv.obs_dim, "action_dim": venv.action_dim, "discrete": venv.discrete}
        return Components(
            source=source,
            learner=learner,
            evaluator=evaluator,
            description=cfg.preset or e.id,
            header=header,
            checkpoint_meta=meta,
            closers=[venv],
        )


def _set_up_process(cfg: Config) -> None:
    """Torch's threads (``run.torch_threads``, else one: the control networks are small) and the
    global RNGs seeded, as each process that builds control parts starts (run, worker, learner rank)."""
    torch.set_num_threads(cfg.run.torch_threads or 1)
    seed_globals(cfg.seed)
