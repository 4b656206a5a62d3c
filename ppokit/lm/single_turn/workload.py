"""The single-turn language-model workload: PPO on prompts with a Hugging Face causal LM.

One iteration, as the run loop (:mod:`ppokit.loop`) drives it::

    LMSource.collect()       prompts.next_batch(); engine.generate(prompts, group_size)   # (N, P + R)
                             sequence rewards: reward model and/or reward function         # (N,)
    Scorer.score()           old/ref log-probs, values; token rewards (+ KL penalty)      # (N, R)
    advantages               GAE over tokens, or a group estimator (ppokit.trainer)
    LMLearner.update()       ppokit.trainer's epochs x mini-batches x micro-batches
    LMEvaluator              greedy held-out accuracy before, during and after training

:class:`LMWorkload` builds these parts (:mod:`.source`, :mod:`ppokit.lm.scoring`,
:mod:`ppokit.lm.learner`, :mod:`.evaluator`); they talk through a
:class:`~ppokit.components.Batch` of plain tensors and lists.

Precision: master weights, the optimizer and the loss math are float32; with
``run.precision`` = bf16 (``auto`` picks it where the hardware has native bf16)
generation, scoring and the update's forward/backward run under bf16 autocast, and
the frozen backbone is stored in bf16 (it has no master weights to keep). The
scoring pass runs the same code under the same autocast as the update, so the first
importance ratio is exactly 1 in bf16 too. On a CPU, ``model.cpu_kernels`` adds
ppokit's fused kernels (:mod:`ppokit.lm.accel`) once the policy is built
(:mod:`ppokit.lm.model.stack`).

The run directory gets ``base_model/`` (:mod:`ppokit.lm.base_model`: the built-in tiny
model or the warm-started model, when either is used), and every checkpoint holds the
policy's files (:mod:`ppokit.lm.model.checkpoint`: adapters or models, value head,
tokenizer) beside the run loop's state (optimizer, schedule, RNGs, prompt position, KL
coefficient).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from ppokit.components import Components
from ppokit.config import Config
from ppokit.errors import UserError
from ppokit.lm.base_model import prepare_model, progress
from ppokit.lm.data.records import count_tokens_with, drop_long_prompts
from ppokit.lm.data.sources import PromptIterator
from ppokit.lm.generation.engine import check_prompts_fit
from ppokit.lm.generation.factory import make_engine
from ppokit.lm.inputs import check_warm_start_heldout, load_data, load_sft_records
from ppokit.lm.learner import LMLearner, learner_policy_stack, make_scorer
from ppokit.lm.model.checkpoint import read_policy_meta
from ppokit.lm.model.device import placement
from ppokit.lm.model.hf import causal_lm_config
from ppokit.lm.model.memory import (
    IterationSizes,
    MemoryEstimate,
    check_run_fits,
    estimate_note,
    has_auto_micro_batches,
    longest_prompt_tokens,
    resolve_micro_batches,
)
from ppokit.lm.model.policy import check_model_options
from ppokit.lm.model.stack import build_policy_stack, prompt_tokenizer
from ppokit.lm.rewards.functions import BUILTIN_REWARDS
from ppokit.lm.rewards.pool import make_reward_scorer
from ppokit.lm.rewards.reward_model import RewardModel
from ppokit.lm.rewards.sandbox import describe_isolation, isolation_warning
from ppokit.lm.rewards.sequence import SequenceRewards
from ppokit.lm.single_turn.dynamic_sampling import check_filter_metric
from ppokit.lm.single_turn.evaluator import LMEvaluator
from ppokit.lm.single_turn.source import LMShardPlan, LMSource
from ppokit.persistence.resume import seed_globals
from ppokit.trainer import DataParallel


@dataclass
class PromptSets:
    """A run's training and held-out prompts within ``data.max_prompt_tokens``."""

    train: list[dict]
    held_out: list[dict]
    dropped: int = 0  # training prompts over the limit
    note: str | None = None  # the run header's line when any prompt was dropped


class CheckedInputs(NamedTuple):
    """What :meth:`LMWorkload.check_inputs` read (:func:`~ppokit.lm.inputs.load_data`'s records and
    reward function, the prompts' tokenizer), kept for :meth:`LMWorkload.build`."""

    train: list[dict]
    held_out: list[dict]
    reward_fn: Any
    tokenizer: Any
    prompt_tokens: int | None = None  # the longest prompt the run keeps, in tokens (the memory estimate's P)
    estimate: MemoryEstimate | None = None  # the pre-start check's memory estimate (None: run.memory_check off)
    sft: list[dict] | None = None  # the warm start's records (None: none, or not read yet)


@dataclass
class RunInputs:
    """What a single-turn run reads before its model is built (:meth:`LMWorkload.build`)."""

    prompts: PromptSets
    verifier: Any  # the reward function's scorer (held-out accuracy; None without a function)
    rewards: SequenceRewards  # the training reward
    sft: list[dict] | None = None  # the warm start's records, as the pre-start check read them
    header: list[str] = field(default_factory=list)  # lines said at the start, after the model's
    closers: list[Any] = field(default_factory=list)  # closed at the run's end (the verifier's workers)


class LMWorkload:
    """Builds the components of a language-model run (:class:`ppokit.components.Workload`)."""

    name = "lm"

    def __init__(self, cfg: Config, data: tuple[list[dict], list[dict], Any] | None = None):
        self.cfg = cfg
        self.model_path: Path | None = None  # set by build: what rollout workers and learner ranks load
        self._data = data  # load_data's result when the registry read it already (ppokit.lm.inputs.read_prompt_run)
        self._checked: CheckedInputs | None = None  # what check_inputs read, for build (then dropped)

    def check_inputs(self) -> None:
        """Prompts, held-out set, reward function and model directory, before a run directory exists;
        what it reads is kept for :meth:`build`, which then reads nothing again."""
        cfg = self.cfg
        train_items, eval_items, reward_fn = self._data or load_data(cfg)
        self._data = None  # kept in _checked from here on
        check_filter_metric(cfg, has_verifier=reward_fn is not None)
        check_model_options(cfg.model)
        tokenizer = prompt_tokenizer(cfg)  # loaded once for every check (a bad directory: one line)
        within_limit = train_items  # the training prompts the run keeps (data.max_prompt_tokens)
        if cfg.data.max_prompt_tokens is not None or cfg.train.micro_batch_tokens is not None:
            within_limit = drop_long(cfg, train_items, eval_items, tokenizer).train
            check_token_budget(cfg, tokenizer, within_limit)
        check_warm_start_heldout(cfg, eval_items)
        sft_items = load_sft_records(cfg)  # too few of them: one line now, not once the run directory exists
        # a run that cannot fit its device's memory: one line now, not an out-of-memory error later
        longest = longest_prompt_tokens(tokenizer, [x["prompt"] for x in within_limit + eval_items])
        estimate = check_run_fits(cfg, IterationSizes(longest), sft_eval_rows=len(eval_items))
        self._checked = CheckedInputs(train_items, eval_items, reward_fn, tokenizer, longest, estimate, sft_items)

    def check_checkpoint(self, meta: dict[str, Any], path: Path) -> None:
        read_policy_meta(path)  # the policy's files are there (a UserError names what is wrong)

    def shard_plan(self, components: Components, num_shards: int) -> LMShardPlan:
        return LMShardPlan(components.source, num_shards)

    def rollout_shard(self, shard: int, num_shards: int) -> LMSource:
        """Generation with the actor alone (lora: the backbone and the actor adapter), built as
        :meth:`build` builds it; the prompts come with each request, the rewards are the driver's."""
        cfg = self.cfg
        seed_globals(cfg.seed)
        stack = build_policy_stack(cfg, self.model_path, need_critic=False, need_reference=False)
        engine = make_engine(stack.policy, stack.tokenizer, cfg.rollout, kv_cache=stack.kv_cache)
        return LMSource(cfg, engine, None, None, stack.device, policy=stack.policy)

    def learner_replica(self, parallel: DataParallel) -> LMLearner:
        """A learner rank's policy (:func:`~ppokit.lm.learner.learner_policy_stack`) and its optimizer."""
        stack = learner_policy_stack(self.cfg, self.model_path, parallel)
        return LMLearner(self.cfg, stack.policy, stack.tokenizer, self.model_path, parallel=parallel)

    def build(self, run_dir: Path) -> Components:
        run_dir.mkdir(parents=True, exist_ok=True)
        seed_globals(self.cfg.seed)
        inputs = self._inputs()
        try:
            return self._build(run_dir, inputs)
        except BaseException:
            for closer in inputs.closers:
                closer.close()
            raise

    def _inputs(self) -> RunInputs:
        """The prompts (auto micro-batch sizes chosen from the longest: ``self.cfg`` updated, what
        every part and the Ray workers read), the verifier and the training reward."""
        device, autocast_dtype = placement(self.cfg)
        checked, self._checked = self._checked, None  # not kept: the Ray workers get a copy of self
        if checked is None:  # not checked first (a library caller's workload): read them now
            checked = CheckedInputs(*load_data(self.cfg), tokenizer=None)
        train_items, eval_items, reward_fn = checked.train, checked.held_out, checked.reward_fn
        header: list[str] = []
        auto = has_auto_micro_batches(self.cfg)  # sized by the longest prompt
        tokenizer = None
        if auto or self.cfg.data.max_prompt_tokens is not None:
            tokenizer = checked.tokenizer if checked.tokenizer is not None else prompt_tokenizer(self.cfg)
        prompts = drop_long(self.cfg, train_items, eval_items, tokenizer)
        if prompts.note:
            header.append(prompts.note)
        longest = checked.prompt_tokens
        if auto:
            longest = longest_prompt_tokens(tokenizer, [x["prompt"] for x in prompts.train + prompts.held_out])
            self.cfg, micro_batches = resolve_micro_batches(self.cfg, IterationSizes(longest))
            header.append(micro_batches)
        cfg = self.cfg
        if longest is not None:  # the estimate of the run as it will run, beside its measured peaks
            known = None if auto else checked.estimate  # the pre-start check's, of this very config
            note = estimate_note(cfg, IterationSizes(longest), sft_eval_rows=len(eval_items), known=known)
            header += [note] if note else []
        # the training reward: the reward model's score and/or a function's (the task's own only
        # without a reward model; held-out accuracy always uses the function)
        train_reward_fn = reward_fn if cfg.data.reward is not None or cfg.data.reward_model is None else None
        reward_model = None
        if cfg.data.reward_model is not None:  # loaded first: a bad one fails before a warm start runs
            reward_model = RewardModel(
                cfg.data.reward_model,
                device=device,
                autocast_dtype=autocast_dtype,
                batch_size=cfg.infer_micro_batch_size,
                cpu_kernels=cfg.model.cpu_kernels,
            )
        verifier = None
        closers: list[Any] = []
        if reward_fn is not None:  # worker processes kept for the run, closed at its end
            verifier = reward_scorer(cfg, reward_fn)
            closers.append(verifier)
            header += reward_notes(reward_fn)
        try:
            rewards = SequenceRewards(
                cfg.data,
                cfg.rollout.max_new_tokens,
                verifier=verifier if train_reward_fn is not None else None,
                reward_model=reward_model,
            )
        except BaseException:
            for closer in closers:
                closer.close()
            raise
        return RunInputs(prompts, verifier, rewards, checked.sft, header, closers)

    def _build(self, run_dir: Path, inputs: RunInputs) -> Components:
        cfg, verifier = self.cfg, inputs.verifier
        train_items, eval_items = inputs.prompts.train, inputs.prompts.held_out
        model_path = prepare_model(
            cfg, run_dir, eval_items, verifier, progress, prompts=train_items + eval_items, sft_examples=inputs.sft
        )
        self.model_path = model_path
        causal_lm_config(model_path, "model.path")  # a clear error before anything heavy
        stack = build_policy_stack(cfg, model_path)
        engine = make_engine(stack.policy, stack.tokenizer, cfg.rollout, kv_cache=stack.kv_cache)
        check_prompts_fit(
            engine, stack.tokenizer, [x["prompt"] for x in train_items + eval_items], cfg.rollout.max_new_tokens
        )  # every prompt, before the first rollout
        check_token_budget(cfg, stack.tokenizer, train_items)
        learner = LMLearner(cfg, stack.policy, stack.tokenizer, model_path)
        prompts = PromptIterator(train_items, cfg.train.batch_size // cfg.algo.group_size, seed=cfg.seed)
        source = LMSource(
            cfg,
            engine,
            prompts,
            inputs.rewards,
            stack.device,
            dropped_prompts=inputs.prompts.dropped,
            policy=stack.policy,
        )
        evaluator = LMEvaluator(cfg, engine, eval_items, verifier) if eval_items and verifier is not None else None
        header = [f"lm: {stack.describe()}, {cfg.iterations} iterations of {cfg.train.batch_size} sequences"]
        header += inputs.header
        described = inputs.rewards.describe()
        if described:
            header.append(described)
        return Components(
            source=source,
            learner=learner,
            scorer=make_scorer(cfg, stack.policy, learner),
            evaluator=evaluator,
            description=cfg.preset or "lm",
            header=header,
            closers=inputs.closers,
        )


# ----------------------------------------------------------------------------- checks and rewards
def drop_long(cfg: Config, train_items: list[dict], eval_items: list[dict], tokenizer=None) -> PromptSets:
    """``data.max_prompt_tokens``: the training and held-out prompts within the limit (counted with
    ``tokenizer``, by default model.path's, the built-in character tokenizer for tiny), the number
    of training prompts dropped and a line for the header when any are."""
    limit = cfg.data.max_prompt_tokens
    if limit is None:
        return PromptSets(train_items, eval_items)
    tokenizer = tokenizer or prompt_tokenizer(cfg)
    kept, dropped = drop_long_prompts(train_items, limit, tokenizer=tokenizer)
    eval_kept, eval_dropped = drop_long_prompts(eval_items, limit, tokenizer=tokenizer) if eval_items else ([], 0)
    note = None
    if dropped or eval_dropped:
        note = (
            f"data: dropped {dropped} of {len(train_items)} training and {eval_dropped} of "
            f"{len(eval_items)} held-out prompts longer than {limit} tokens (data.max_prompt_tokens)"
        )
    return PromptSets(kept, eval_kept, dropped, note)


def check_token_budget(cfg: Config, tokenizer, items: list[dict]) -> None:
    """``train.micro_batch_tokens`` must hold the longest sequence a rollout can make."""
    budget = cfg.train.micro_batch_tokens
    if budget is None:
        return
    prompts = [x["prompt"] for x in items]
    longest = max(count_tokens_with(tokenizer)(prompts), default=0) if prompts else 0
    longest += cfg.rollout.max_new_tokens
    if budget < longest:
        raise UserError(
            f"train.micro_batch_tokens={budget} is less than the longest sequence a rollout can make "
            f"({longest} tokens: the longest prompt plus rollout.max_new_tokens); raise it to at "
            f"least {longest}"
        )


def reward_scorer(cfg: Config, reward_fn):
    """The run's reward scorer for ``reward_fn`` (a RewardFunction): in this process for the cheap
    built-ins, else a pool of worker processes with ``data.reward_timeout`` per sample. The error
    limit is :class:`~ppokit.lm.rewards.sequence.SequenceRewards`' (over the run)."""
    d = cfg.data
    spec = reward_fn.spec if BUILTIN_REWARDS.get(reward_fn.spec) is reward_fn.fn else reward_fn
    return make_reward_scorer(
        spec,
        num_workers=d.reward_workers,
        timeout=d.reward_timeout,
        reward_on_error=d.reward_on_error,
        max_reward_errors=None,
    )


def reward_notes(reward_fn) -> list[str]:
    """Lines for the run's header: the code reward says how its programs are isolated (and warns,
    once, when the network is not cut off)."""
    if reward_fn.spec != "code":
        return []
    warning = isolation_warning()
    return [describe_isolation()] + ([f"WARNING: {warning}"] if warning else [])
