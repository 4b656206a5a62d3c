"""``ppokit eval`` of a language model: a run directory (its trained actor) or a Hugging Face model directory.

:func:`report_run` is what the command prints (:data:`ppokit.workloads.EVALUATORS`).
:func:`evaluate_lm` evaluates a run directory (its trained actor,
:attr:`ppokit.persistence.rundir.RunDir.lm_checkpoint`) or a Hugging Face model directory, on the run's
held-out set or on a dataset (``--data``). It reports the greedy mean reward, greedy pass@1,
sampled pass@k (the unbiased estimator of :mod:`ppokit.algo.evaluation`) and the mean response
length. The run's held-out set and reward come from its config (``data.eval_prompts`` or the
built-in task's held-out split, ``data.reward``), so the greedy mean reward is the number the run
printed as "held-out accuracy after PPO". Rewards run in the reward pool: a raise or a hang
scores 0 and is counted. A multi-turn run's evaluation is :mod:`ppokit.lm.multi_turn.run_eval`.
"""

from __future__ import annotations

import json as json_module
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ppokit.algo.evaluation import mean_pass_at_k
from ppokit.errors import UserError
from ppokit.lm.data.chat import chat_renderer, render_records
from ppokit.lm.data.sources import is_file_source, load_prompts
from ppokit.lm.data.tasks import get_task
from ppokit.lm.generation.loading import load_generator
from ppokit.lm.inputs import load_heldout
from ppokit.lm.rewards.functions import BUILTIN_REWARDS
from ppokit.lm.rewards.pool import make_reward_scorer
from ppokit.persistence.rundir import RunDir


def evaluate_lm(
    path: str | Path | RunDir,
    *,
    data: str | None = None,
    reward: str | None = None,
    size: int | None = None,
    samples: int = 0,
    k: Sequence[int] = (),
    threshold: float = 1.0,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    chat_template: bool | None = None,
    reward_timeout: float = 30.0,
    seed: int = 0,
    device: str | None = None,
    **sampling: Any,
) -> dict[str, Any]:
    """What ``ppokit eval`` reports for a language model: a run (its trained actor; a path or its
    :class:`~ppokit.persistence.rundir.RunDir`) or a model directory.

    Prompts: ``data`` (a task, or a JSONL / Parquet file / datasets directory read with
    ``prompt_key`` and ``answer_key``; its held-out split for a task), else the run's held-out
    set; the first ``size`` of them. Reward: ``reward``, else the run's (or the task's own).
    It runs in the reward pool with ``reward_timeout`` seconds per sample: a failure scores 0
    and is counted (``reward_errors``).

    Returns ``prompts``, ``mean_reward`` (greedy), ``pass@1_greedy`` (share of prompts whose
    greedy response scores at least ``threshold``), ``mean_length`` (greedy response tokens)
    and, with ``samples`` = n > 0 sampled responses per prompt (the run's sampling options, or
    ``sampling``'s), ``sampled_mean_reward``, ``sampled_mean_length`` and ``pass@K`` for each K
    in ``k``: the unbiased estimator (:func:`ppokit.algo.evaluation.mean_pass_at_k`).
    """
    ks = sorted({int(x) for x in k})
    if samples < 0 or (ks and samples < max(ks)) or any(x < 1 for x in ks):
        raise UserError(
            f"--k must be between 1 and --samples (got k={ks or None}, samples={samples}); pass@k "
            "needs at least k samples per prompt"
        )
    gen = load_generator(path, device=device, **sampling)
    items, reward_spec = _eval_items(gen, data, reward, prompt_key, answer_key, chat_template)
    if size is not None:
        items = items[:size]
    scorer = make_reward_scorer(
        reward_spec, num_workers=None if samples else 1, timeout=reward_timeout, max_reward_errors=None
    )
    try:
        torch.manual_seed(seed)
        prompts = [it["prompt"] for it in items]
        out = {"model": gen.label, "prompts": len(items), "reward": reward_spec}
        out.update(_greedy_metrics(gen, scorer, prompts, items, threshold))
        if samples:
            sampled_out, sampled_errors = _sampled_metrics(gen, scorer, prompts, items, samples, ks, threshold)
            out.update(sampled_out)
            out["reward_errors"] += sampled_errors
    finally:
        scorer.close()
    out["threshold"] = threshold
    if isinstance(reward_spec, str) and reward_spec not in BUILTIN_REWARDS:
        out["reward"] = str(reward_spec)
    return out


def _greedy_metrics(gen, scorer, prompts: list, items: list, threshold: float) -> dict[str, Any]:
    """One greedy response per prompt: the mean reward, the share scoring at least ``threshold``,
    the mean length, and the number of reward errors."""
    greedy = gen.engine.generate(prompts, greedy=True, items=items)
    results = scorer.score(prompts, greedy.texts, items)
    scores = torch.tensor(results.scores, dtype=torch.float64)  # (P,)
    return {
        "mean_reward": scores.mean().item(),
        "pass@1_greedy": (scores >= threshold).double().mean().item(),
        "mean_length": greedy.response_lengths.double().mean().item(),
        "reward_errors": results.num_errors,
    }


def _sampled_metrics(
    gen, scorer, prompts: list, items: list, samples: int, ks: Sequence[int], threshold: float
) -> tuple[dict[str, Any], int]:
    """``samples`` sampled responses per prompt: their mean reward and length, and ``pass@K`` for
    each K in ``ks``; and the number of reward errors."""
    sampled = gen.engine.generate(prompts, group_size=samples, items=items)
    sampled_lengths = sampled.response_lengths.double()  # (P * n,)
    results = scorer.score(list(sampled.prompts), list(sampled.texts), list(sampled.items))
    sampled_scores = torch.tensor(results.scores, dtype=torch.float64).view(len(items), samples)  # (P, n)
    out: dict[str, Any] = {
        "samples": samples,
        "temperature": gen.engine.cfg.temperature,
        "sampled_mean_reward": sampled_scores.mean().item(),
        "sampled_mean_length": sampled_lengths.mean().item(),
    }
    for kk in ks:
        out[f"pass@{kk}"] = mean_pass_at_k(sampled_scores >= threshold, kk)
    return out, results.num_errors


def _eval_items(
    gen,
    data: str | None,
    reward: str | None,
    prompt_key: str | None,
    answer_key: str | None,
    chat_template: bool | None,
) -> tuple[list[dict], str]:
    """The held-out records and the reward spec for :func:`evaluate_lm`."""
    cfg = gen.cfg
    if data is None:
        if cfg is None:
            raise UserError(
                "--data is needed with a model directory: a task (e.g. arithmetic, gsm8k:path=...) or "
                "a JSONL / Parquet file or datasets directory of prompts and answers"
            )
        if reward is not None:
            cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"reward": reward})})
        items, reward_spec = load_heldout(cfg, gen.tokenizer, where="the checkpoint")
        if reward_spec is None:
            raise UserError("the run is scored by its reward model alone; give a verifier with --reward")
        if not items:
            raise UserError("the run has no held-out prompts; give them with --data")
        return items, reward_spec.strip()
    keys = {
        "prompt_key": prompt_key or (cfg.data.prompt_key if cfg else "prompt"),
        "answer_key": answer_key or (cfg.data.answer_key if cfg else "answer"),
    }
    use_template = chat_template if chat_template is not None else bool(cfg and cfg.data.chat_template)
    if is_file_source(data):
        if reward is None:
            raise UserError(
                f"--reward is needed with the file {data}: a built-in (exact_match, numeric_match, "
                "math, code, countdown), module:fn or file.py:fn"
            )
        items = load_prompts(data, "eval", chat=use_template, **keys)
    else:
        items = load_prompts(data, "eval")
        reward = reward or get_task(data).default_reward
    if use_template:
        items = render_records(items, chat_renderer(gen.tokenizer, gen.label))
    return items, reward


def format_eval_table(result: dict[str, Any]) -> str:
    """The result of :func:`evaluate_lm` as an aligned two-column table."""
    rows = [
        ("model", result["model"]),
        ("prompts", str(result["prompts"])),
        ("reward", str(result["reward"])),
        ("mean reward (greedy)", f"{result['mean_reward']:.4f}"),
        (f"pass@1 (greedy, reward >= {result['threshold']:g})", f"{result['pass@1_greedy']:.1%}"),
        ("mean length (greedy, tokens)", f"{result['mean_length']:.1f}"),
    ]
    if result.get("samples"):
        n = result["samples"]
        rows += [
            (f"mean reward ({n} samples, T={result['temperature']:g})", f"{result['sampled_mean_reward']:.4f}"),
            ("mean length (sampled, tokens)", f"{result['sampled_mean_length']:.1f}"),
        ]
        rows += [
            (f"{key} (unbiased, n={n})", f"{result[key]:.1%}")
            for key in result
            if key.startswith("pass@") and key != "pass@1_greedy"
        ]
    if result.get("reward_errors"):
        rows.append(("reward errors (scored 0)", str(result["reward_errors"])))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def report_run(
    run: RunDir,
    /,
    *,
    data: str | None = None,
    reward: str | None = None,
    prompts: int | None = None,
    samples: int = 0,
    k: Sequence[int] | None = None,
    threshold: float = 1.0,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    chat_template: bool | None = None,
    reward_timeout: float = 30.0,
    seed: int | None = None,
    device: str | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    max_new_tokens: int | None = None,
    json: bool = False,
    **_: Any,
) -> str:
    """What ``ppokit eval`` prints for a language-model run or model directory (its options, by
    name): :func:`evaluate_lm` on the first ``prompts`` prompts, pass@1 and pass@``samples`` by
    default when sampling; a table (:func:`format_eval_table`), or indented JSON with ``json``."""
    result = evaluate_lm(
        run,
        data=data,
        reward=reward,
        size=prompts,
        samples=samples,
        k=k if k is not None else (sorted({1, samples}) if samples else []),
        threshold=threshold,
        prompt_key=prompt_key,
        answer_key=answer_key,
        chat_template=chat_template,
        reward_timeout=reward_timeout,
        seed=seed or 0,
        device=device,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
    )
    return json_module.dumps(result, indent=2) if json else format_eval_table(result)
