"""The language-model workload: PPO on a Hugging Face causal LM.

One iteration, all of it visible in :func:`train_lm`::

    items   = prompts.next_batch()                       # batch_size / group_size prompts
    rollout = engine.generate(items, group_size)         # (N, P + R) tokens, (N, R) mask
    scores  = reward_model.score(...) + score_responses(reward_fn, ...)   # (N,) either or both
    scored  = scorer.score(rollout)                      # old/ref log-probs, values (N, R)
    rewards = token_rewards(scores, mask, kl)            # reward on the last real token
    adv, ret = compute_advantages(cfg, rewards, values)  # GAE over tokens, or a group estimator
    metrics = learner.update(batch)                      # ppokit.trainer: the shared PPO loop
    tracker.log(...)

Generation (:class:`~ppokit.lm.rollout.RolloutEngine`), scoring
(:class:`~ppokit.lm.scoring.Scorer`) and the update (:class:`Learner`) talk through
plain tensors and lists, so each can move to its own (Ray) worker later.

Precision: master weights, the optimizer and the loss math are float32; with
``run.precision`` = bf16 (``auto`` picks it where the hardware has native bf16)
generation, scoring and the update's forward/backward run under bf16 autocast, and
the frozen backbone is stored in bf16 (it has no master weights to keep). The
scoring pass runs the same code under the same autocast as the update, so the first
importance ratio is exactly 1 in bf16 too.

The run directory gets ``base_model/`` (the built-in tiny model or the warm-started
model, when either is used; ``ppokit_base_model.json`` in it, written last, marks it
complete), ``checkpoint/`` at the end and ``checkpoints/iter-NNNNNN`` every
``run.checkpoint_every`` iterations and on SIGINT/SIGTERM (adapters or models, value
head, tokenizer: see :meth:`~ppokit.lm.policy.LMPolicy.save`; ``trainer/``: optimizer,
schedule, RNGs, prompt position, KL coefficient, counters, evaluation history, config)
and ``metrics.jsonl``.

Exact resume (``resume_from``, see :mod:`ppokit.resume`): the run is rebuilt exactly as
a fresh one (the complete ``base_model/`` is reused: no second warm start), the
checkpoint's weights and states are copied in, the RNGs restored last, and the loop
goes on; on the CPU the continuation is bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional

import torch

from ppokit.config import Config
from ppokit.errors import UserError

CHECKPOINT_DIR = "checkpoint"      # RUN_DIR/checkpoint: the final checkpoint
PERIODIC_DIR = "checkpoints"       # RUN_DIR/checkpoints/iter-NNNNNN: run.checkpoint_every, SIGINT/SIGTERM
TRAINER_DIR = "trainer"            # CKPT/trainer: a ppokit checkpoint; its meta.json is written last
MARKER = f"{TRAINER_DIR}/meta.json"   # = ppokit.resume.CHECKPOINT_MARKERS["lm"]
BASE_MODEL_DIR = "base_model"
BASE_MODEL_MARKER = "ppokit_base_model.json"   # in base_model/, written when it is complete
INIT_MODEL_DIR = "init_model"
KL_METRIC_ROWS = 64               # without a KL term, kl_ref is measured on this many sequences
SMALL_MODEL_PARAMS = 20_000_000   # CPU: below this, one torch thread unless run.torch_threads says otherwise


# ----------------------------------------------------------------------------- pieces
class Learner:
    """The update side: the policy's optimizer and the shared PPO loop."""

    def __init__(self, cfg: Config, policy, total_iterations: int):
        from ppokit.trainer import PPOTrainer

        self.policy = policy
        self.trainer = PPOTrainer(cfg, policy, total_iterations=total_iterations)

    def update(self, batch: dict[str, torch.Tensor], iteration: int) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self.trainer.update(batch, iteration)
        seconds = time.perf_counter() - start
        tokens = float(batch["attention_mask"].sum()) * metrics["epochs"]
        metrics["time_update"] = seconds
        metrics["train_tokens_per_s"] = tokens / max(seconds, 1e-9)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def needs_scored_old_log_prob(self, cfg: Config) -> bool:
        """Whether the scorer must run the actor pass: not when the update makes one
        optimizer step (its own forward gives the old log-probs) and the rewards carry no
        KL term that needs them before the update."""
        return cfg.algo.use_kl_in_reward or not self.trainer.fully_on_policy(cfg.train.batch_size)


def _kernels_note(policy) -> str:
    """``" + fused CPU kernels (rms_norm 21, mlp 10, rotary 10, attention 10, lora_amx 70)"`` when
    any layer took them."""
    counts = {kind: n for kind, n in policy.fused_kernel_counts.items() if n}
    if not counts:
        return ""
    return " + fused CPU kernels (" + ", ".join(f"{kind} {n}" for kind, n in counts.items()) + ")"


def setup(cfg: Config) -> tuple[torch.device, Optional[torch.dtype]]:
    """Threads and every global RNG seeded; (device, autocast dtype or None) from ``run.device``/``run.precision``."""
    import random

    import numpy as np

    from ppokit.lm.policy import resolve_precision

    if cfg.run.torch_threads:
        torch.set_num_threads(cfg.run.torch_threads)
    # every global RNG a reward function or sampler may draw from (all of them are checkpointed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    torch.manual_seed(cfg.seed)
    device = resolve_device_name(cfg)
    return device, resolve_precision(cfg.run.precision, device)


def one_thread_if_small(cfg: Config, policy, device: torch.device) -> None:
    """CPU, no ``run.torch_threads``, a model under SMALL_MODEL_PARAMS: one torch thread.

    Small matmuls gain little from threads, and more threads than free cores (other
    processes) slow them down many times over.
    """
    if cfg.run.torch_threads is None and device.type == "cpu" and \
            sum(p.numel() for p in policy.parameters()) < SMALL_MODEL_PARAMS:
        torch.set_num_threads(1)


def chat_render(cfg: Config, tokenizer=None, where: Optional[str] = None):
    """``data.chat_template``'s renderer (:func:`ppokit.lm.chat.chat_renderer`) with ``tokenizer``
    (default: model.path's), or None when prompts are used as they are."""
    from ppokit.lm.chat import chat_renderer, model_chat_renderer

    if not cfg.data.chat_template:
        return None
    if tokenizer is None:
        return model_chat_renderer(cfg.model.path, what="model.path", option="data.chat_template=true",
                                   fix="set model.path to a chat model's directory")
    return chat_renderer(tokenizer, where or "the model")


def load_data(cfg: Config, tokenizer=None, where: Optional[str] = None) -> tuple[list[dict], list[dict], Any]:
    """(train prompt records, held-out records, reward function), checked before any model loads.

    The reward function is ``data.reward``, else the task's own; None for a prompt file
    scored by ``data.reward_model`` alone (there is then no held-out accuracy). With
    ``data.chat_template`` the prompts come rendered with the chat template of
    ``tokenizer`` (``where`` names it in errors; default: model.path's tokenizer).
    """
    from ppokit.lm.chat import render_records
    from ppokit.lm.data import is_file_source, load_prompts
    from ppokit.lm.rewards import load_reward_fn

    d = cfg.data
    from_file = is_file_source(d.prompts)
    if d.reward is None:
        if from_file:
            if d.reward_model is None:
                raise UserError(f"data.reward: the prompt file {d.prompts} needs a reward function "
                                "(a built-in name, module:fn or file.py:fn) or data.reward_model")
            if d.eval_prompts is not None and d.eval_size:
                raise UserError("data.eval_prompts: the held-out accuracy is scored by data.reward (a verifier), "
                                "and the reward model alone does not say what is correct; set data.reward, or "
                                "data.eval_size=0")
            reward_spec = None
        else:
            from ppokit.lm.tasks import get_task

            reward_spec = get_task(d.prompts).default_reward
    else:
        reward_spec = d.reward
    reward_fn = load_reward_fn(reward_spec) if reward_spec is not None else None
    chat = d.chat_template
    train_items = load_prompts(d.prompts, "train", chat=chat)
    if d.eval_size == 0:
        eval_items = []
    elif d.eval_prompts is not None:
        eval_items = load_prompts(d.eval_prompts, "eval", chat=chat)[:d.eval_size]
    elif not from_file:
        eval_items = load_prompts(d.prompts, "eval", n=d.eval_size)
    else:
        eval_items = []
    render = chat_render(cfg, tokenizer, where)
    if render is not None:
        train_items, eval_items = render_records(train_items, render), render_records(eval_items, render)
    return train_items, eval_items, reward_fn


def prepare_model(cfg: Config, run_dir: Path, eval_items: list[dict], reward_fn, log) -> Path:
    """The backbone's directory: model.path, the built-in tiny model, and/or a warm-started copy.

    A complete ``RUN_DIR/base_model`` (its :data:`BASE_MODEL_MARKER` is written last) is
    reused as it is: a resumed run does not warm-start again. An incomplete one (a run
    killed while building it) is deleted and built again, deterministically.
    """
    import shutil

    path = cfg.model.path
    base = run_dir / BASE_MODEL_DIR
    if path == "tiny" or cfg.data.sft_epochs:
        if path == "tiny" and cfg.run.torch_threads is None and resolve_device_name(cfg).type == "cpu":
            torch.set_num_threads(1)    # the built-in model is small (see SMALL_MODEL_PARAMS)
        if (base / BASE_MODEL_MARKER).is_file():
            return base
        for leftover in [base, *run_dir.glob(f".{BASE_MODEL_DIR}.*"), *run_dir.glob(f".{INIT_MODEL_DIR}.*")]:
            if leftover.is_dir():      # a killed build or warm start: start it over
                shutil.rmtree(leftover)
    if path == "tiny":
        from ppokit.lm.tiny import build_tiny_model

        target = run_dir / (INIT_MODEL_DIR if cfg.data.sft_epochs else BASE_MODEL_DIR)
        path = str(build_tiny_model(target, seed=cfg.seed))
    if cfg.data.sft_epochs:
        from ppokit.lm.data import load_prompts
        from ppokit.lm.sft import run_sft

        if not eval_items:
            raise UserError("data.sft_epochs > 0 needs held-out prompts to pick the best warm-start model "
                            "(a built-in task, or data.eval_prompts)")
        examples = load_prompts(cfg.data.prompts, "sft", n=cfg.data.sft_examples, chat=cfg.data.chat_template)
        render = chat_render(cfg)
        if render is not None:
            from ppokit.lm.chat import render_records

            examples = render_records(examples, render)
        run_sft(path, run_dir / BASE_MODEL_DIR, examples, eval_items, epochs_max=cfg.data.sft_epochs,
                batch_size=cfg.data.sft_batch_size, learning_rate=cfg.data.sft_learning_rate, seed=cfg.seed,
                precision=cfg.run.precision, reward_fn=reward_fn, max_new_tokens=cfg.rollout.max_new_tokens,
                device=str(resolve_device_name(cfg)), log=log)
        path = str(run_dir / BASE_MODEL_DIR)
    if path == str(base):
        marker = {"model.path": cfg.model.path, "data.sft_epochs": cfg.data.sft_epochs, "seed": cfg.seed}
        (base / BASE_MODEL_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return Path(path)


def available_devices() -> list[str]:
    """The ``run.device`` values this machine can run: auto, cpu, then cuda, cuda:N and mps when present."""
    names = ["auto", "cpu"]
    if torch.cuda.is_available():
        names += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        names.append("mps")
    return names


def resolve_device_name(cfg: Config) -> torch.device:
    """``run.device`` as a ``torch.device``; one this machine lacks is a :class:`UserError` naming the choices."""
    from ppokit.lm.policy import resolve_device

    name = cfg.run.device
    choices = available_devices()
    if name not in choices:
        raise UserError(f"run.device={name}: no such device on this machine; available: {', '.join(choices)}")
    return resolve_device(name)


def evaluate(policy, tokenizer, items: list[dict], reward_fn, cfg: Config) -> float:
    """Greedy held-out accuracy (mean reward) of the actor."""
    from ppokit.lm.sft import evaluate_accuracy

    model = policy.actor_model
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    with policy.use("actor"):
        return evaluate_accuracy(model, tokenizer, items, reward_fn, batch_size=cfg.rollout.micro_batch_size,
                                 max_new_tokens=cfg.rollout.max_new_tokens, greedy=True,
                                 precision="bf16" if policy.autocast_dtype is not None else "fp32")


def rollout_metrics(rollout, scores: torch.Tensor, scored: dict[str, torch.Tensor]) -> dict[str, float]:
    lengths = rollout.response_lengths
    out = {"reward_mean": scores.mean().item(), "reward_std": scores.std(unbiased=False).item(),
           "reward_max": scores.max().item(), "response_length": lengths.mean().item(),
           "truncated_frac": rollout.truncated.float().mean().item(),
           "time_generate": rollout.generation_time,
           "gen_tokens_per_s": lengths.sum().item() / max(rollout.generation_time, 1e-9)}
    ref = scored.get("ref_log_prob", scored.get("ref_log_prob_metric"))     # (N or K, R)
    if ref is not None:
        k = ref.shape[0]
        seq_kl = ((scored["old_log_prob"][:k] - ref) * rollout.mask[:k]).sum(1)   # (k,) k1 sums
        out["kl_ref"] = seq_kl.mean().item()
    return out


def rollout_samples(rollout, scores: torch.Tensor, k: int) -> list[dict[str, Any]]:
    """The first ``k`` sequences of a rollout as JSON rows: prompt, response, sequence reward,
    response tokens, truncated, and the prompt's data fields (``answer``, ...). The prompts
    are shuffled, so they are a random sample; with ``group_size`` > 1 they are one group."""
    from ppokit.lm.rewards import reward_fields

    lengths = rollout.response_lengths
    return [{"prompt": rollout.prompts[i], "response": rollout.texts[i], "reward": float(scores[i]),
             "length": int(lengths[i]), "truncated": bool(rollout.truncated[i]),
             "fields": reward_fields(rollout.items[i])} for i in range(min(k, len(rollout)))]


# ----------------------------------------------------------------------------- the loop
def train_lm(cfg: Config, run_dir: Path | str, resume_from: Optional[Path | str] = None) -> dict[str, Any]:
    """Train; save ``RUN_DIR/checkpoint``; the final metrics with held-out accuracy before/after.

    ``resume_from``: a checkpoint of this run (see :func:`ppokit.resume.find_resume_checkpoint`);
    training continues exactly where it stopped, ``metrics.jsonl`` rows written after it
    are dropped first. Checkpoints go to ``RUN_DIR/checkpoints/iter-NNNNNN`` every
    ``run.checkpoint_every`` iterations (the newest ``run.keep_checkpoints`` kept). The
    first SIGINT/SIGTERM ends the iteration, saves a checkpoint and raises
    :class:`~ppokit.errors.Interrupted`; ``train.max_bad_steps`` non-finite steps in a
    row raise :class:`~ppokit.errors.TrainingDiverged` naming the last good checkpoint.
    """
    from ppokit import algo, checkpoint, resume
    from ppokit.lm.data import PromptIterator
    from ppokit.lm.policy import build_policy, causal_lm_config, load_tokenizer
    from ppokit.lm.rollout import RolloutEngine, check_prompts_fit
    from ppokit.lm.scoring import Scorer, kl_to_reference, token_rewards
    from ppokit.trainer import compute_advantages
    from ppokit.track import Tracker

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    a = cfg.algo
    device, autocast_dtype = setup(cfg)
    train_items, eval_items, reward_fn = load_data(cfg)
    # the training reward: the reward model's score and/or a function's (the task's own only
    # without a reward model; held-out accuracy always uses reward_fn)
    train_reward_fn = reward_fn if cfg.data.reward is not None or cfg.data.reward_model is None else None
    reward_model = None
    if cfg.data.reward_model is not None:     # loaded first: a bad one fails before a warm start runs
        from ppokit.lm.reward_model import RewardModel

        reward_model = RewardModel(cfg.data.reward_model, device=device, autocast_dtype=autocast_dtype,
                                   batch_size=cfg.train.infer_micro_batch_size, cpu_kernels=cfg.model.cpu_kernels)
    saved = None
    if resume_from is not None:
        resume_from = Path(resume_from)
        saved = read_training_state(resume_from, cfg, run_dir)   # checked before anything is built
        if saved.meta.get("finished") or saved.meta["iteration"] >= cfg.iterations:
            resume.truncate_metrics(run_dir, saved.meta["iteration"])
            return _finished_result(run_dir, resume_from, saved.meta)
    # The tracker (metrics.jsonl, TensorBoard's purge of the steps logged again) comes once the
    # run is built and any checkpoint loaded: a resume that fails leaves the run as it was.
    tracker = None
    try:
        model_path = prepare_model(cfg, run_dir, eval_items, reward_fn, _print)
        causal_lm_config(model_path, "model.path")            # a clear error before anything heavy
        tokenizer = load_tokenizer(model_path, "model.path")
        policy = build_policy(cfg, model_path, device=device, autocast_dtype=autocast_dtype, seed=cfg.seed)
        one_thread_if_small(cfg, policy, device)
        kl_in_loss_or_reward = a.beta > 0 or a.use_kl_in_reward
        engine = RolloutEngine(policy, tokenizer, cfg.rollout)
        check_prompts_fit(policy.actor_model, tokenizer, [x["prompt"] for x in train_items + eval_items],
                          cfg.rollout.max_new_tokens)     # every prompt, before the first rollout
        learner = Learner(cfg, policy, cfg.iterations)
        scorer = Scorer(policy, cfg.train.infer_micro_batch_size, need_reference=kl_in_loss_or_reward,
                        metric_rows=KL_METRIC_ROWS, need_old_log_prob=learner.needs_scored_old_log_prob(cfg))
        kl_ctrl = algo.make_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl,
                                          a.kl_ctrl.horizon) if a.use_kl_in_reward else None
        prompts = PromptIterator(train_items, cfg.train.batch_size // a.group_size, seed=cfg.seed)
        summary: dict[str, Any] = {}
        eval_history: list[dict[str, float]] = []
        start_it = 0
        if saved is not None:
            with resume.advising_on_damage(resume_from, run_dir, marker=MARKER):
                start_it, summary, eval_history = load_training_state(saved, resume_from, policy, learner,
                                                                      prompts, kl_ctrl)
            resume.truncate_metrics(run_dir, start_it)    # only now: the resume goes ahead
        # TensorBoard steps are iterations: the resumed run logs the checkpoint's iteration first
        tracker = Tracker(run_dir, cfg, cfg.iterations, purge_step=start_it if saved is not None else None)
        precision = "bf16" if autocast_dtype is not None else "fp32"
        tracker.message(f"lm: {model_path} ({cfg.model.mode}, {_count(policy):,} trainable parameters), "
                        f"{device}, {precision}{_kernels_note(policy)}, {cfg.iterations} iterations of "
                        f"{cfg.train.batch_size} sequences")
        if saved is not None:
            tracker.message(f"resumed from {resume_from} at iteration {start_it}")
        elif eval_items:
            acc = evaluate(policy, tokenizer, eval_items, reward_fn, cfg)
            summary["eval_accuracy_before"] = acc
            eval_history.append({"iteration": 0, "accuracy": acc})
            tracker.message(f"held-out accuracy before PPO: {acc:.1%} ({len(eval_items)} prompts)")
        state = dict(cfg=cfg, policy=policy, tokenizer=tokenizer, model_path=model_path, learner=learner,
                     prompts=prompts, kl_ctrl=kl_ctrl, eval_history=eval_history, summary=summary)
        metrics: dict[str, Any] = {}
        with resume.GracefulStop() as stop:
            for it in range(start_it, cfg.iterations):
                iteration_start = time.perf_counter()
                items = prompts.next_batch()
                rollout = engine.generate([x["prompt"] for x in items], group_size=a.group_size, items=items)
                start = time.perf_counter()
                scores, reward_parts = sequence_scores(rollout, reward_model, train_reward_fn, device)   # (N,)
                time_reward = time.perf_counter() - start
                start = time.perf_counter()
                scored = scorer.score(rollout)
                time_score = time.perf_counter() - start
                kl = None
                if a.use_kl_in_reward:
                    kl = kl_to_reference(scored["old_log_prob"], scored["ref_log_prob"], rollout.mask,
                                         a.kl_penalty)
                rewards = token_rewards(scores, rollout.mask, kl=kl, kl_coef=kl_ctrl.value if kl_ctrl else 0.0)
                adv, ret = compute_advantages(cfg, rewards=rewards, mask=rollout.mask,
                                              values=scored["old_values"] if a.adv_estimator == "gae" else None,
                                              group_ids=rollout.group_ids)
                batch = {**rollout.tensors(), **scored, "advantages": adv, "returns": ret}
                batch.pop("ref_log_prob_metric", None)   # (K, R): for the kl_ref metric only
                if not kl_in_loss_or_reward or a.beta == 0:
                    batch.pop("ref_log_prob", None)     # the update does not need it
                try:
                    metrics = learner.update(batch, it)
                except resume.TrainingDiverged as exc:
                    raise resume.diverged_message(exc, run_dir, marker=MARKER) from None
                if "old_log_prob" not in scored:     # fully on-policy: the update computed them
                    scored["old_log_prob"] = learner.trainer.on_policy_log_prob * rollout.mask
                metrics.update(rollout_metrics(rollout, scores, scored), **reward_parts)
                if cfg.run.log_samples and it % cfg.run.samples_every == 0:
                    tracker.log_samples(it, rollout_samples(rollout, scores, cfg.run.log_samples))
                metrics.update(time_reward=time_reward, time_score=time_score,
                               score_tokens_per_s=float(rollout.attention_mask.sum()) / max(time_score, 1e-9))
                if kl_ctrl is not None:
                    seq_kl = (kl.sum(1)).mean().item()
                    metrics["kl_coef"] = kl_ctrl.value
                    kl_ctrl.update(seq_kl, len(rollout))
                if eval_items and cfg.data.eval_every and (it + 1) % cfg.data.eval_every == 0 \
                        and it + 1 < cfg.iterations:
                    metrics["eval_accuracy"] = evaluate(policy, tokenizer, eval_items, reward_fn, cfg)
                    eval_history.append({"iteration": it + 1, "accuracy": metrics["eval_accuracy"]})
                metrics["samples"] = (it + 1) * len(rollout)
                metrics["time_iteration"] = time.perf_counter() - iteration_start
                _check_finite(metrics, it)
                # The row goes out before the checkpoint of the same iteration: a resumed run
                # truncates metrics.jsonl to its checkpoint, so nothing is lost or repeated.
                tracker.log(it, metrics)
                if it + 1 == cfg.iterations:
                    break                               # the final checkpoint follows
                every = cfg.run.checkpoint_every
                periodic = every and (it + 1) % every == 0
                if stop.requested:
                    tracker.message(f"received {stop.signal_name}: saving a checkpoint after iteration {it}")
                if periodic or stop.requested:
                    _check_weights(policy, run_dir, it + 1)
                    path = save_run_checkpoint(resume.periodic_checkpoint_path(run_dir, it + 1), **state,
                                               iteration=it + 1)
                    checkpoint.prune_checkpoints(run_dir / PERIODIC_DIR, cfg.run.keep_checkpoints)
                    if stop.requested:
                        raise stop.interrupted(path, run_dir)
            # inside the signal guard: a SIGINT/SIGTERM now lets the final checkpoint be written
            if eval_items:
                acc = evaluate(policy, tokenizer, eval_items, reward_fn, cfg)
                summary["eval_accuracy_after"] = acc
                eval_history.append({"iteration": cfg.iterations, "accuracy": acc})
                tracker.message(f"held-out accuracy after PPO: {acc:.1%} "
                                f"(before: {summary['eval_accuracy_before']:.1%})")
            _check_weights(policy, run_dir, cfg.iterations)
            ckpt = save_run_checkpoint(run_dir / CHECKPOINT_DIR, **state, iteration=cfg.iterations, finished=True)
    finally:
        if tracker is not None:
            tracker.close()
    result = {k: v for k, v in metrics.items()}
    result.update(summary)
    result["eval_history"] = eval_history
    result["checkpoint"] = str(ckpt)
    return result


# ----------------------------------------------------------------------------- checkpoints
def save_run_checkpoint(path: Path, cfg: Config, policy, tokenizer, model_path: Path, learner, prompts,
                        kl_ctrl, *, iteration: int, eval_history: Optional[list] = None,
                        summary: Optional[dict] = None, finished: bool = False) -> Path:
    """``path/``: the policy (:meth:`LMPolicy.save`) and ``path/trainer/``, a ppokit checkpoint
    (optimizer, schedule and shuffle generator, every RNG, prompt position, KL coefficient,
    counters, evaluation history, config; safetensors + JSON, no pickle) whose ``meta.json``
    is the completion marker. Written into a temporary sibling and renamed into place: a
    crash leaves the previous checkpoint (:func:`ppokit.checkpoint.recover_interrupted`
    tidies up)."""
    from ppokit import checkpoint, resume

    with checkpoint.atomic_directory(path) as tmp:
        policy.save(tmp, base_model=str(model_path), tokenizer=tokenizer)
        parts = {"trainer": learner.state_dict(), "prompts": prompts.state_dict(), "rng": resume.capture_rng()}
        if kl_ctrl is not None:
            parts["kl_ctrl"] = kl_ctrl.state_dict()
        meta = {"workload": "lm", "iteration": iteration, "finished": finished,
                "eval_history": list(eval_history or []), "summary": dict(summary or {}), "config": cfg.to_dict()}
        for file in tmp.rglob("*"):        # the policy's files (save_checkpoint fsyncs trainer/)
            if file.is_file():
                checkpoint.fsync_path(file)
        checkpoint.save_checkpoint(tmp / TRAINER_DIR, parts, meta)
    return Path(path)


def read_training_state(path: Path, cfg: Config, run_dir: Path):
    """The ``trainer/`` checkpoint of ``path``, checked to be a resumable checkpoint of this run."""
    from ppokit import checkpoint, resume

    with resume.advising_on_damage(path, run_dir, marker=MARKER):
        ckpt = checkpoint.load_checkpoint(Path(path) / TRAINER_DIR)
    meta_file = Path(path) / MARKER
    if ckpt.meta.get("workload", "lm") != "lm":
        raise UserError(f"checkpoint file {meta_file} is not a language-model checkpoint")
    resume.check_resumable_config(ckpt.meta.get("config", {}), cfg.to_dict(), run_dir)
    missing = [k for k in ("trainer", "prompts", "rng") if k not in ckpt.parts]
    if cfg.algo.use_kl_in_reward and "kl_ctrl" not in ckpt.parts:
        missing.append("kl_ctrl")
    if missing or "workload" not in ckpt.meta:
        raise UserError(f"checkpoint {path} cannot be resumed from: it has no "
                        f"{', '.join(missing) or 'workload'} state (written by an older ppokit?)")
    resume.checked_iteration(ckpt.meta, path, cfg.iterations, run_dir, marker=MARKER)
    return ckpt


def load_training_state(ckpt, path: Path, policy, learner, prompts, kl_ctrl) -> tuple[int, dict, list]:
    """Copy a checkpoint (:func:`read_training_state`) into a freshly built run, RNGs last.

    Returns (completed iterations, summary, evaluation history). A mismatch or damage is a
    one-line :class:`UserError` naming the checkpoint.
    """
    from ppokit import resume

    try:
        policy.load_trained_state(path)
        learner.trainer.load_state_dict(_actor_only(ckpt.parts["trainer"], policy, learner, path))
        prompts.load_state_dict(ckpt.parts["prompts"])
        if kl_ctrl is not None:
            kl_ctrl.load_state_dict(ckpt.parts["kl_ctrl"])
        summary = dict(ckpt.meta.get("summary", {}))
        history = [dict(x) for x in ckpt.meta.get("eval_history", [])]
        resume.restore_rng(ckpt.parts["rng"])     # last: building the run used the RNGs too
    except UserError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"checkpoint {path} does not match this run ({reason})") from None
    return int(ckpt.meta["iteration"]), summary, history


def _actor_only(trainer_state: dict, policy, learner, path: Path) -> dict:
    """The trainer state for ``policy``: a checkpoint written before critic-free runs built no
    critic (GRPO, RLOO, REINFORCE++ with an untrained critic) holds optimizer state for the
    critic's parameters too, after the actor's; a run without a critic drops it."""
    from ppokit.lm.policy import read_policy_meta

    if policy.has_critic or not read_policy_meta(path)["critic"]:
        return trainer_state
    n = len(learner.trainer.optimizer.params)
    optim = dict(trainer_state["optimizer"])
    for key in ("steps", "exp_avg", "exp_avg_sq"):
        optim[key] = list(optim[key])[:n]
    optim["lr"] = list(optim["lr"])[:1]
    return {**trainer_state, "optimizer": optim}


def sequence_scores(rollout, reward_model, reward_fn, device: torch.device) -> tuple[torch.Tensor, dict]:
    """(N,) float32 sequence rewards: the reward model's score plus the reward function's
    (either may be None); with a reward model, the parts' means as metrics."""
    from ppokit.lm.rewards import score_responses

    parts: dict[str, torch.Tensor] = {}
    if reward_model is not None:
        parts["reward_model_mean"] = torch.tensor(reward_model.score(rollout.prompts, rollout.texts, rollout.items))
    if reward_fn is not None:
        parts["reward_fn_mean"] = torch.tensor(score_responses(reward_fn, rollout.prompts, rollout.texts,
                                                               rollout.items))
    scores = torch.zeros(len(rollout), dtype=torch.float32)
    for part in parts.values():
        scores += part
    metrics = {name: part.mean().item() for name, part in parts.items()} if reward_model is not None else {}
    return scores.to(device), metrics


def _finished_result(run_dir: Path, path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    from ppokit.track import read_metrics

    rows = read_metrics(run_dir)
    result = dict(rows[-1]) if rows else {}
    result.update(meta.get("summary", {}))
    result.update(iterations=int(meta["iteration"]), eval_history=meta.get("eval_history", []),
                  checkpoint=str(path), run_dir=str(run_dir), already_finished=True)
    return result


def _print(text: str) -> None:
    """Progress lines before the tracker (and its progress bar) exists."""
    print(text, flush=True)


def _count(policy) -> int:
    return sum(p.numel() for p in policy.parameters() if p.requires_grad)


def _check_finite(metrics: dict[str, Any], iteration: int) -> None:
    """A non-finite reward is the reward function's fault: stop with a one-line error.

    Non-finite losses are the trainer's business: it skips such steps and stops after
    ``train.max_bad_steps`` of them in a row (:class:`~ppokit.errors.TrainingDiverged`).
    """
    value = metrics.get("reward_mean")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"iteration {iteration}: reward_mean is {value}; check the reward function "
                        "(the metrics so far are in metrics.jsonl)")


def _check_weights(policy, run_dir: Path, iteration: int) -> None:
    """Refuse to save non-finite weights over (or prune) the good checkpoints."""
    from ppokit import resume

    if not resume.all_finite(p for p in policy.parameters() if p.requires_grad):
        raise resume.diverged_message(resume.TrainingDiverged(
            f"training diverged: the policy's weights are not finite after iteration {iteration}"), run_dir,
            marker=MARKER)
