"""The language-model workload on a text environment (``textenv.env`` set): multi-turn PPO.

Built like :class:`~ppokit.lm.single_turn.workload.LMWorkload` (the same policy stack,
scorer, learner and checkpoint files), with :class:`~ppokit.lm.multi_turn.source.MultiTurnSource` as the source and
:class:`~ppokit.lm.multi_turn.source.TextEnvEvaluator` as the evaluator::

    warm start (data.sft_epochs > 0): demonstrations played in the environment
        (textenv.sft_policy: random legal actions, or the environment's expert), the
        held-out score is the legal-action rate (random) or agreement with the expert
    policy (LoRA actor + critic; with a self-play pool a third adapter slot for opponents)
    MultiTurnSource -> Scorer -> trajectory advantages (:mod:`.advantages`) -> LMLearner
        (a fixed number of mini-batches)
    TextEnvEvaluator: greedy win rates before, during and after training

``train.batch_size`` counts episodes; the rows an iteration trains on vary (one per turn
in state mode, one per seat in message mode), so each epoch is split into
``train.batch_size / train.mini_batch_size`` mini-batches of rows, and
``train.micro_batch_size`` / ``train.infer_micro_batch_size`` count rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from ppokit.components import Components
from ppokit.config import Config
from ppokit.envs import checked_reset, make_env
from ppokit.errors import UserError
from ppokit.lm.generation.factory import make_engine
from ppokit.lm.learner import LMLearner, learner_policy_stack, make_scorer
from ppokit.lm.model.checkpoint import read_policy_meta
from ppokit.lm.model.hf import causal_lm_config, load_tokenizer
from ppokit.lm.model.memory import (
    IterationSizes,
    MemoryEstimate,
    check_run_fits,
    estimate_note,
    has_auto_micro_batches,
    resolve_micro_batches,
)
from ppokit.lm.model.policy import check_model_options, lora_config
from ppokit.lm.model.stack import PolicyStack, build_policy_stack
from ppokit.lm.multi_turn.advantages import trajectory_advantages
from ppokit.lm.multi_turn.demonstrations import check_warm_start_mode, warm_started_model
from ppokit.lm.multi_turn.opponents import AdapterSnapshots
from ppokit.lm.multi_turn.shards import MultiTurnShard, MultiTurnShardPlan
from ppokit.lm.multi_turn.sizing import env_mode, iteration_sizes
from ppokit.lm.multi_turn.source import (
    MultiTurnSource,
    TextEnvEvaluator,
    check_env_output,
    engine_generate,
    make_envs,
    player_for,
)
from ppokit.lm.multi_turn.streams import StreamCodec, messages_without_template
from ppokit.persistence.resume import seed_globals
from ppokit.trainer import DataParallel

__all__ = ["MultiTurnWorkload"]


class MultiTurnWorkload:
    """Builds the components of a multi-turn run (:class:`ppokit.components.Workload`)."""

    name = "lm"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._estimate: MemoryEstimate | None = None  # the pre-start check's memory estimate, for the header

    def check_inputs(self) -> None:
        """The environment builds and the model directory loads, before a run directory exists."""
        env = make_env(self.cfg.textenv.env, **self.cfg.textenv.kwargs)
        if self.cfg.model.path != "tiny":
            causal_lm_config(self.cfg.model.path)
            load_tokenizer(self.cfg.model.path)
        check_model_options(self.cfg.model)
        check_warm_start_mode(self.cfg, env_mode(env), getattr(env, "env_name", self.cfg.textenv.env))
        self._check_observation(env)
        self._check_eval_opponents()
        self._check_memory()

    def _check_eval_opponents(self) -> None:
        """Each of ``textenv.eval_opponents`` builds its environment (``opponent=`` added to the
        kwargs): the evaluation before training would refuse it once the run directory exists."""
        t = self.cfg.textenv
        for opponent in t.eval_opponents:
            try:
                make_env(t.env, **{**t.kwargs, "opponent": opponent})
            except UserError as exc:
                raise UserError(
                    f"textenv.eval_opponents={t.eval_opponents}: {exc} (set textenv.eval_opponents=[] to "
                    "evaluate on the environment as trained)"
                ) from None

    def _check_observation(self, env: Any) -> None:
        """Chat messages as observations need a chat template: refused before the run starts (the
        first step would refuse them after the run directory and the warm start)."""
        name = getattr(env, "env_name", self.cfg.textenv.env)
        try:
            observation, _ = checked_reset(env, seed=self.cfg.seed, name=name)
        except UserError:
            return  # a failing reset is the run's to report (textenv.failure_reward)
        if not isinstance(observation, str) and not self.cfg.data.chat_template:
            raise UserError(messages_without_template(name))

    def _check_memory(self) -> None:
        """Refuse a run that cannot fit its device's memory, sized by probe episodes (:mod:`.sizing`)."""
        if self._sizes is not None:
            self._estimate = check_run_fits(self.cfg, self._sizes, sft_eval_rows=self.cfg.textenv.sft_eval_turns)

    @cached_property
    def _sizes(self) -> IterationSizes | None:
        """The estimate's sizes of an iteration, probed once in a fresh environment (the pre-start
        check and the header's estimate share them: the micro-batch sizes do not change them)."""
        t = self.cfg.textenv
        env = make_env(t.env, **t.kwargs)
        return iteration_sizes(self.cfg, env, getattr(env, "env_name", t.env))

    def _sizing_notes(self) -> list[str]:
        """``self.cfg`` with its ``auto`` micro-batch sizes chosen; the header's lines: the sizes
        chosen and the memory estimate of the run as it will run."""
        sizes, known = self._sizes, self._estimate  # the pre-start check's estimate, unless auto sizes change cfg
        lines = []
        if has_auto_micro_batches(self.cfg):
            self.cfg, line = resolve_micro_batches(self.cfg, sizes or IterationSizes(0))
            lines.append(line)
            known = None
        if sizes is not None:
            note = estimate_note(self.cfg, sizes, sft_eval_rows=self.cfg.textenv.sft_eval_turns, known=known)
            lines += [note] if note else []
        return lines

    def check_checkpoint(self, meta: dict[str, Any], path: Path) -> None:
        read_policy_meta(path)

    def build(self, run_dir: Path) -> Components:
        run_dir.mkdir(parents=True, exist_ok=True)
        sizing = self._sizing_notes()
        cfg, t = self.cfg, self.cfg.textenv
        seed_globals(cfg.seed)
        probe = make_env(t.env, **t.kwargs)
        env_name = getattr(probe, "env_name", t.env)
        mode = check_env_output(probe, env_name)
        model_path = warm_started_model(cfg, run_dir, probe, env_name, mode)
        self.model_path, self.mode, self.env_name = model_path, mode, env_name  # what Ray workers build from
        causal_lm_config(model_path, "model.path")
        stack = build_policy_stack(cfg, model_path)
        rollout = self._rollout_parts(stack, cfg.train.batch_size)
        source = MultiTurnSource(
            cfg,
            rollout.player,
            mode=mode,
            pad_id=stack.tokenizer.pad_token_id,
            device=stack.device,
            opponents=rollout.opponents,
            env_name=env_name,
            engine=rollout.engine,
            policy=stack.policy,
        )
        learner = self._learner(stack.policy, stack.tokenizer)
        evaluator = None
        if t.eval_episodes:
            evaluator = TextEnvEvaluator(cfg, engine_generate(rollout.engine), rollout.codec, rollout.context, env_name)
        a = cfg.algo
        credit = (
            f"credit by {a.credit}"
            if cfg.uses_critic
            else f"{a.adv_estimator} over groups of {a.group_size} episodes of one seed"
        )
        header = [
            f"lm on {env_name} ({mode} mode, {credit}): {stack.describe()}, "
            f"{cfg.iterations} iterations of {cfg.train.batch_size} episodes"
        ]
        header += sizing
        return Components(
            source=source,
            learner=learner,
            scorer=make_scorer(cfg, stack.policy, learner),
            evaluator=evaluator,
            description=cfg.preset or f"lm-{t.env}",
            header=header,
            advantages=trajectory_advantages,
        )

    def _rollout_parts(self, stack: PolicyStack, num_envs: int) -> RolloutParts:
        """What plays episodes with the stack's policy over ``num_envs`` environments."""
        cfg, t = self.cfg, self.cfg.textenv
        policy, tokenizer = stack.policy, stack.tokenizer
        opponents = AdapterSnapshots(policy, lora_config(cfg.model)) if t.pool.snapshot_every else None
        engine = make_engine(policy, tokenizer, cfg.rollout, kv_cache=stack.kv_cache)
        opponent_engine = None
        if opponents is not None:  # snapshots live in a spare adapter slot: the HF engine samples from it
            opponent_engine = make_engine(
                policy,
                tokenizer,
                cfg.rollout,
                kind="hf",
                activate=opponents.activate,
                kv_cache=stack.kv_cache,
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
        context = engine.max_positions
        generate = engine_generate(engine, opponents, opponent_engine)
        player = player_for(cfg, make_envs(t.env, t.kwargs, num_envs), codec, generate, context, self.env_name)
        return RolloutParts(engine, opponents, codec, context, player)

    def _learner(self, policy, tokenizer, parallel: DataParallel | None = None) -> LMLearner:
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

    # ------------------------------------------------------------------ Ray workers (ppokit.cluster)
    def shard_plan(self, components: Components, num_shards: int) -> MultiTurnShardPlan:
        return MultiTurnShardPlan(components.source, num_shards)

    def rollout_shard(self, shard: int, num_shards: int) -> MultiTurnShard:
        """A worker's player: the actor alone (lora: the backbone, the actor adapter and, with a pool,
        the opponent slot), built as :meth:`build` builds it, over its share of the environments."""
        seed_globals(self.cfg.seed)
        stack = build_policy_stack(self.cfg, self.model_path, need_critic=False, need_reference=False)
        rollout = self._rollout_parts(stack, self.cfg.train.batch_size // num_shards)
        return MultiTurnShard(
            rollout.player,
            stack.policy,
            rollout.opponents,
            cfg=self.cfg,
            mode=self.mode,
            pad_id=stack.tokenizer.pad_token_id,
            device=stack.device,
        )

    def learner_replica(self, parallel: DataParallel) -> LMLearner:
        """A learner rank's policy (:func:`~ppokit.lm.learner.learner_policy_stack`) and its optimizer."""
        stack = learner_policy_stack(self.cfg, self.model_path, parallel)
        return self._learner(stack.policy, stack.tokenizer, parallel)


@dataclass
class RolloutParts:
    """What plays a run's episodes: the engine, the self-play pool (or None), the stream codec,
    the model's context and the player over the run's (or a worker's) environments."""

    engine: Any
    opponents: AdapterSnapshots | None
    codec: StreamCodec
    context: int | None
    player: Any
