"""The language-model workload on a text environment (``textenv.env`` set): multi-turn PPO.

Built like :class:`~ppokit.lm.single_turn.workload.LMWorkload` (same policy, scorer, learner and
checkpoint files), with :class:`~ppokit.lm.multi_turn.source.MultiTurnSource` as the source and
:class:`~ppokit.lm.multi_turn.source.TextEnvEvaluator` as the evaluator::

    warm start (data.sft_epochs > 0): demonstrations played in the environment
        (textenv.sft_policy: random legal actions, or the environment's expert), the
        held-out score is the legal-action rate (random) or agreement with the expert
    policy (LoRA actor + critic; with a self-play pool a third adapter slot for opponents)
    MultiTurnSource -> Scorer -> algo.credit advantages -> LMLearner (fixed number of mini-batches)
    TextEnvEvaluator: greedy win rates before, during and after training

``train.batch_size`` counts episodes; the rows an iteration trains on vary (one per turn
in state mode, one per seat in message mode), so each epoch is split into
``train.batch_size / train.mini_batch_size`` mini-batches of rows, and
``train.micro_batch_size`` / ``train.infer_micro_batch_size`` count rows.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ppokit.components import Components
from ppokit.config import Config
from ppokit.envs import checked_reset, expert_policy, make_env, play_episode, random_legal_policy
from ppokit.errors import UserError
from ppokit.lm.scoring import Scorer
from ppokit.lm.single_turn.workload import (
    KL_METRIC_ROWS,
    LMLearner,
    _print,
    needs_ref_log_prob,
    prepare_model,
    setup,
    small_model_threads,
)

__all__ = ["MultiTurnWorkload", "demonstration_examples", "legal_action_reward"]

SFT_EVAL_RECORDS = 256
SFT_EVAL_SEED = 10**12  # held-out demonstration episodes: seeds far from the training ones


def legal_action_reward(prompt: str, response: str, *, legal_actions: list, **_: Any) -> float:
    """1.0 when the response (stripped) is one of the position's legal actions."""
    return float(response.strip() in legal_actions)


def demonstration_examples(env: Any, policy_kind: str, n: int, *, seed: int, name: str) -> list[dict[str, Any]]:
    """``n`` warm-start records ``{"prompt", "completion", "answer", "legal_actions"}`` from episodes
    played with ``policy_kind`` (``random``: uniform over ``info["legal_actions"]``; ``random_wins``:
    the same play, keeping only the turns of seats that won, i.e. demonstrations chosen by the
    environment's outcome alone, rejection sampling; ``expert``: the environment's
    ``expert_action()``), seeds ``seed, seed + 1, ...``: the observation the policy saw, byte for
    byte what a rollout shows, and the action it wrote."""
    if policy_kind in ("random", "random_wins"):
        _, info = checked_reset(env, seed=seed, name=name)
        if not info.get("legal_actions"):
            raise UserError(
                f"textenv.sft_policy={policy_kind} needs an environment that lists info['legal_actions'] "
                f"('{name}' does not); use textenv.sft_policy=expert"
            )
        policy = random_legal_policy(random.Random(seed))
    else:
        try:
            policy = expert_policy(env)
        except TypeError:
            raise UserError(
                f"textenv.sft_policy=expert needs the environment's expert_action() ('{name}' has "
                "none); use textenv.sft_policy=random or data.sft_epochs=0"
            ) from None
    records: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []  # this episode's, in turn order

    def recording(observation: Any, info: dict) -> str:
        if not isinstance(observation, str):
            raise UserError(
                f"environment '{name}': a warm start from demonstrations needs text observations "
                "(observation_mode='state'); set data.sft_epochs=0"
            )
        action = policy(observation, info)
        turns.append(
            {
                "prompt": observation,
                "completion": action,
                "answer": action,
                "legal_actions": list(info.get("legal_actions") or []),
            }
        )
        return action

    episode = 0
    while len(records) < n:
        turns.clear()
        played = play_episode(env, recording, seed=seed + episode, name=name)
        if policy_kind == "random_wins":
            winners = {seat for seat, record in played.records.items() if record.outcome == "win"}
            records.extend(t for t, turn in zip(turns, played.turns) if turn.player in winners)
        else:
            records.extend(turns)
        episode += 1
        if episode > 1000 * n:
            raise UserError(
                f"environment '{name}': {episode} demonstration episodes gave only {len(records)} "
                f"turns{' of winning seats' if policy_kind == 'random_wins' else ''}; use "
                "textenv.sft_policy=random"
            )
    return records[:n]


class MultiTurnWorkload:
    """Builds the components of a multi-turn run (:class:`ppokit.components.Workload`)."""

    name = "lm"

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def check_inputs(self) -> None:
        """The environment builds and the model directory loads, before a run directory exists."""
        from ppokit.lm.model.hf import causal_lm_config, load_tokenizer

        make_env(self.cfg.textenv.env, **self.cfg.textenv.kwargs)
        if self.cfg.model.path != "tiny":
            causal_lm_config(self.cfg.model.path)
            load_tokenizer(self.cfg.model.path)

    def check_checkpoint(self, meta: dict[str, Any], path: Path) -> None:
        from ppokit.lm.model.checkpoint import read_policy_meta

        read_policy_meta(path)

    def build(self, run_dir: Path) -> Components:
        from ppokit import algo
        from ppokit.lm.model.hf import causal_lm_config, load_tokenizer
        from ppokit.lm.model.policy import build_policy
        from ppokit.lm.multi_turn.source import MultiTurnSource, TextEnvEvaluator, check_env_output, engine_generate

        cfg, t, a = self.cfg, self.cfg.textenv, self.cfg.algo
        run_dir.mkdir(parents=True, exist_ok=True)
        device, autocast_dtype = setup(cfg)
        probe = make_env(t.env, **t.kwargs)
        env_name = getattr(probe, "env_name", t.env)
        mode = check_env_output(probe, env_name)
        model_path = self._prepare_model(run_dir, probe, env_name, mode)
        self.model_path, self.mode, self.env_name = model_path, mode, env_name  # what Ray workers build from
        causal_lm_config(model_path, "model.path")
        tokenizer = load_tokenizer(model_path, "model.path")
        policy = build_policy(cfg, model_path, device=device, autocast_dtype=autocast_dtype, seed=cfg.seed)
        rollout = self._rollout_parts(policy, tokenizer, cfg.train.batch_size)
        source = MultiTurnSource(
            cfg,
            rollout.player,
            mode=mode,
            pad_id=tokenizer.pad_token_id,
            device=device,
            opponents=rollout.opponents,
            env_name=env_name,
        )
        learner = self._learner(policy, tokenizer)
        kl_ctrl = (
            algo.make_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl, a.kl_ctrl.horizon)
            if a.use_kl_in_reward
            else None
        )
        scorer = Scorer(
            policy,
            cfg.train.infer_micro_batch_size,
            need_reference=needs_ref_log_prob(cfg),
            metric_rows=KL_METRIC_ROWS,
            need_old_log_prob=learner.needs_scored_old_log_prob(),
            kl_ctrl=kl_ctrl,
            kl_penalty=a.kl_penalty,
            micro_batch_tokens=cfg.train.micro_batch_tokens,
        )
        evaluator = None
        if t.eval_episodes:
            evaluator = TextEnvEvaluator(cfg, engine_generate(rollout.engine), rollout.codec, rollout.context, env_name)
        precision = "bf16" if autocast_dtype is not None else "fp32"
        trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        header = [
            f"lm on {env_name} ({mode} mode, credit by {a.credit}): {model_path} ({cfg.model.mode}, "
            f"{trainable:,} trainable parameters), {device}, {precision}{rollout.accel_note}, {cfg.iterations} "
            f"iterations of {cfg.train.batch_size} episodes"
        ]
        return Components(
            source=source,
            learner=learner,
            scorer=scorer,
            evaluator=evaluator,
            description=cfg.preset or f"lm-{t.env}",
            header=header,
        )

    def _rollout_parts(self, policy, tokenizer, num_envs: int) -> SimpleNamespace:
        """What plays episodes with ``policy``: the engine (and with a pool the opponent slot and its
        engine), the stream codec, the context, and a player over ``num_envs`` environments."""
        from ppokit.lm.generation.engine import RolloutEngine, max_positions
        from ppokit.lm.model.device import one_thread_if_small
        from ppokit.lm.model.policy import lora_config
        from ppokit.lm.multi_turn.opponents import AdapterSnapshots
        from ppokit.lm.multi_turn.source import engine_generate, make_envs, player_for
        from ppokit.lm.multi_turn.streams import StreamCodec

        cfg, t = self.cfg, self.cfg.textenv
        opponents = AdapterSnapshots(policy, lora_config(cfg.model)) if t.pool.snapshot_every else None
        accel_note, kv_cache = "", None
        if cfg.model.cpu_kernels:
            from ppokit.lm.accel import accelerate_policy

            acceleration = accelerate_policy(policy)
            accel_note, kv_cache = acceleration.describe(), acceleration.kv_cache
        one_thread_if_small(cfg, policy, policy.device)
        engine = RolloutEngine.for_policy(policy, tokenizer, cfg.rollout, kv_cache=kv_cache)
        opponent_engine = None
        if opponents is not None:
            opponent_engine = RolloutEngine(
                policy.actor_model,
                tokenizer,
                cfg.rollout,
                autocast_dtype=policy.autocast_dtype,
                activate=opponents.activate,
                kv_cache=kv_cache,
                eos_ids=engine.eos_ids,
            )
        codec = StreamCodec(
            tokenizer,
            mode=self.mode,
            chat=cfg.data.chat_template,
            where=f"model.path={cfg.model.path}",
            env_name=self.env_name,
            stop_ids=engine.eos_ids,
        )
        context = max_positions(engine.model)
        generate = engine_generate(engine, opponents, opponent_engine)
        envs = make_envs(t.env, t.kwargs, num_envs)
        player = player_for(cfg, envs, codec, generate, context, self.env_name)
        return SimpleNamespace(
            engine=engine, opponents=opponents, codec=codec, context=context, player=player, accel_note=accel_note
        )

    def _learner(self, policy, tokenizer, parallel=None) -> LMLearner:
        cfg = self.cfg
        return LMLearner(
            cfg,
            policy,
            tokenizer,
            self.model_path,
            parallel,
            num_mini_batches=cfg.train.batch_size // cfg.mini_batch_size,
            horizon=cfg.textenv.max_episode_tokens,
        )

    # ------------------------------------------------------------------ Ray workers (ppokit.dist)
    def shard_plan(self, components: Components, num_shards: int):
        from ppokit.lm.multi_turn.shards import MultiTurnShardPlan

        return MultiTurnShardPlan(components.source, num_shards)

    def rollout_shard(self, shard: int, num_shards: int):
        """A worker's player: the actor alone (lora: the backbone, the actor adapter and, with a pool,
        the opponent slot), built as :meth:`build` builds it, over its share of the environments."""
        from ppokit.lm.model.hf import load_tokenizer
        from ppokit.lm.model.policy import build_policy
        from ppokit.lm.multi_turn.shards import MultiTurnShard

        cfg = self.cfg
        device, autocast_dtype = setup(cfg)
        small_model_threads(cfg)
        tokenizer = load_tokenizer(self.model_path, "model.path")
        policy = build_policy(
            cfg,
            self.model_path,
            device=device,
            autocast_dtype=autocast_dtype,
            seed=cfg.seed,
            need_critic=False,
            need_reference=False,
        )
        rollout = self._rollout_parts(policy, tokenizer, cfg.train.batch_size // num_shards)
        return MultiTurnShard(rollout.player, policy, rollout.opponents)

    def learner_replica(self, parallel):
        """The policy (actor, critic) and its optimizer on a learner rank, built as :meth:`build` builds them."""
        from ppokit.lm.model.hf import load_tokenizer
        from ppokit.lm.model.policy import build_policy

        cfg = self.cfg
        device, autocast_dtype = setup(cfg)
        small_model_threads(cfg)
        tokenizer = load_tokenizer(self.model_path, "model.path")
        policy = build_policy(
            cfg,
            self.model_path,
            device=torch.device("cpu") if getattr(parallel, "shards", False) else device,
            autocast_dtype=autocast_dtype,
            seed=cfg.seed,
            need_reference=cfg.algo.beta > 0 and cfg.algo.kl_loss_type == "full",
        )
        if cfg.model.cpu_kernels:
            from ppokit.lm.accel import accelerate_policy

            accelerate_policy(policy)
        return self._learner(policy, tokenizer, parallel)

    def _prepare_model(self, run_dir: Path, env: Any, env_name: str, mode: str) -> Path:
        """The backbone: model.path or the tiny model, warm-started on demonstrations when data.sft_epochs > 0."""
        cfg = self.cfg
        if not cfg.data.sft_epochs:
            return prepare_model(cfg, run_dir, [], None, _print)
        if mode != "state":
            raise UserError(
                f"environment '{env_name}' has observation_mode='message'; a warm start from "
                "demonstrations needs 'state' observations: set data.sft_epochs=0"
            )
        from ppokit.lm.single_turn.workload import BASE_MODEL_DIR, BASE_MODEL_MARKER

        if (run_dir / BASE_MODEL_DIR / BASE_MODEL_MARKER).is_file():  # a resumed run: warm-started already
            return prepare_model(cfg, run_dir, [], None, _print)
        kind = cfg.textenv.sft_policy
        train = demonstration_examples(env, kind, cfg.data.sft_examples, seed=cfg.seed, name=env_name)
        held_out = demonstration_examples(env, kind, SFT_EVAL_RECORDS, seed=SFT_EVAL_SEED + cfg.seed, name=env_name)
        if cfg.data.chat_template:
            from ppokit.lm.data.chat import render_records
            from ppokit.lm.data.inputs import chat_render

            held_out = render_records(held_out, chat_render(cfg))
        reward: Callable = legal_action_reward if kind != "expert" else "exact_match"
        score = "the legal-action rate" if kind != "expert" else "agreement with the expert"
        _print(
            f"warm start on {len(train)} {kind} demonstration turns of {env_name} (held out: "
            f"{len(held_out)}, scored by {score})"
        )
        return prepare_model(cfg, run_dir, held_out, reward, _print, sft_examples=train)
