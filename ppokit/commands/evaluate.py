"""``ppokit eval``: a control run's return; for a language model, mean reward, greedy pass@1,
sampled pass@k, mean length.

:func:`run` picks by what RUN_DIR holds: a multi-turn run, a language-model run or model
directory, else a control run (:func:`ppokit.control.evaluate.evaluate_run`).

:func:`evaluate_lm` evaluates a run directory (its trained actor,
:func:`ppokit.lm.model.checkpoint.find_lm_checkpoint`)
or a Hugging Face model directory, on the run's held-out set or on a dataset (``--data``).
It reports the greedy mean reward, greedy pass@1, sampled pass@k (the unbiased estimator
of :mod:`ppokit.algo.evaluation`) and the mean response length. The run's held-out set and
reward come from its config (``data.eval_prompts`` or the built-in task's held-out split,
``data.reward``), so the greedy mean reward is the number the run printed as "held-out
accuracy after PPO". Rewards run in the reward pool: a raise or a hang scores 0 and is
counted.

:func:`evaluate_textenv_run` evaluates a multi-turn run (``textenv.env`` set): its greedy
win rates or success rate, as the run's own evaluations measure them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ppokit.commands.arguments import SEED_MAX, add_command, int_at_least, positive_float
from ppokit.errors import UserError

LM_EVAL_OPTIONS = (
    "data",
    "reward",
    "samples",
    "k",
    "prompt_key",
    "answer_key",
    "chat_template",
    "temperature",
    "top_p",
    "max_new_tokens",
    "json",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "eval",
        run,
        help="evaluate a trained run's policy, or a model directory on a dataset",
        description="Control run: run the deterministic policy of RUN_DIR's checkpoint and "
        "print the mean and std of the episode return. Language model (a run's "
        "trained actor, or a Hugging Face model directory with --data): the greedy "
        "mean reward, greedy pass@1, sampled pass@k (unbiased estimator, with "
        "--samples N --k K) and the mean response length, as a table or --json; on "
        "a text environment (textenv), its greedy win rates.",
    )
    parser.add_argument(
        "run_dir",
        metavar="RUN_DIR|MODEL_DIR",
        help="a run directory, one of its checkpoint directories, or a language model's directory",
    )
    parser.add_argument(
        "--episodes",
        type=int_at_least(1),
        default=None,
        help="control: episodes to run (default 10); text environment: greedy episodes against each "
        "evaluation opponent (default: the run's textenv.eval_episodes)",
    )
    parser.add_argument(
        "--prompts",
        type=int_at_least(1),
        default=None,
        help="language model: prompts to score (default: all of the held-out set)",
    )
    parser.add_argument(
        "--seed",
        type=int_at_least(0, SEED_MAX),
        default=None,
        help="evaluation seed (control default: the run's seed + 10000; language model: 0)",
    )
    _add_lm_options(parser)
    parser.add_argument("--temperature", type=positive_float, default=None, help="sampling temperature (the run's)")
    parser.add_argument("--top-p", type=positive_float, default=None, help="nucleus sampling (the run's)")
    parser.add_argument(
        "--max-new-tokens", type=int_at_least(1), default=None, help="response length limit (the run's)"
    )
    parser.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: the run's, else auto)")
    parser.add_argument("--json", action="store_true", help="language model: print the result as JSON")


def _add_lm_options(parser: argparse.ArgumentParser) -> None:
    """--data, --reward, --samples, --k, --threshold, --prompt-key, --answer-key, --chat-template,
    --reward-timeout."""
    parser.add_argument(
        "--data",
        default=None,
        help="language model: the prompts, a task (its held-out split) or a "
        "JSONL / Parquet file / datasets directory (default: the run's held-out set)",
    )
    parser.add_argument(
        "--reward",
        default=None,
        help="language model: the verifier, a built-in, module:fn or "
        "file.py:fn (default: the run's, or the task's own)",
    )
    parser.add_argument(
        "--samples",
        type=int_at_least(0),
        default=0,
        help="language model: sampled responses per prompt for pass@k (default 0: greedy only)",
    )
    parser.add_argument(
        "--k",
        type=int_at_least(1),
        nargs="+",
        default=None,
        metavar="K",
        help="language model: pass@K for each K (needs --samples >= K; default: 1 and --samples)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=1.0,
        help="language model: a response is correct when its reward is at least this (default 1)",
    )
    parser.add_argument("--prompt-key", default=None, help="language model: the prompt field of --data")
    parser.add_argument("--answer-key", default=None, help="language model: the answer field of --data")
    parser.add_argument(
        "--chat-template",
        action="store_true",
        default=None,
        help="language model: render prompts with the model's chat template (default: as the run did)",
    )
    parser.add_argument(
        "--reward-timeout",
        type=positive_float,
        default=30.0,
        help="language model: seconds per sample before a reward counts as failed (default 30)",
    )


def run(args: argparse.Namespace) -> int:
    """A multi-turn run, a language-model run or model directory, else a control run."""
    from ppokit.rundir import evaluation_checkpoint, saved_config

    path = Path(args.run_dir)
    is_model_dir = path.is_dir() and (path / "config.json").is_file()
    ckpt = evaluation_checkpoint(path) if path.is_dir() else None
    saved = (saved_config(ckpt) if ckpt is not None else None) or {}
    is_lm_run = saved.get("workload") == "lm"
    if is_lm_run and (saved.get("textenv") or {}).get("env") is not None:  # a multi-turn run
        result = evaluate_textenv_run(path, args.episodes, device=args.device)
        print(f"{result['message']} ({result['checkpoint']})")
        return 0
    if path.is_dir() and (is_lm_run or is_model_dir):
        k = args.k if args.k is not None else (sorted({1, args.samples}) if args.samples else [])
        result = evaluate_lm(
            path,
            data=args.data,
            reward=args.reward,
            size=args.prompts,
            samples=args.samples,
            k=k,
            threshold=args.threshold,
            prompt_key=args.prompt_key,
            answer_key=args.answer_key,
            chat_template=args.chat_template,
            reward_timeout=args.reward_timeout,
            seed=args.seed or 0,
            device=args.device,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
        )
        print(json.dumps(result, indent=2) if args.json else format_eval_table(result))
        return 0
    given = [f"--{name.replace('_', '-')}" for name in LM_EVAL_OPTIONS if getattr(args, name) not in (None, False, 0)]
    if given:
        raise UserError(
            f"{args.run_dir} is not a language-model run or model directory, and {', '.join(given)} "
            "apply to language models only"
        )
    from ppokit.control.evaluate import evaluate_run

    episodes = args.episodes or 10
    mean, std = evaluate_run(args.run_dir, episodes, seed=args.seed)
    print(f"return over {episodes} episodes: {mean:.2f} +- {std:.2f}")
    return 0


def evaluate_lm(
    path: str | Path,
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
    """What ``ppokit eval`` reports for a language model: a run (its trained actor) or a model directory.

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
    import torch

    from ppokit.lm.evaluate import score_texts
    from ppokit.lm.generation.loading import load_generator
    from ppokit.lm.rewards.functions import BUILTIN_REWARDS
    from ppokit.lm.rewards.pool import make_reward_scorer

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
        greedy = gen.engine.generate(prompts, greedy=True, items=items)
        greedy_results = score_texts(scorer, prompts, greedy.texts, items)
        scores = torch.tensor(greedy_results.scores, dtype=torch.float64)  # (P,)
        out: dict[str, Any] = {
            "model": gen.label,
            "prompts": len(items),
            "reward": reward_spec,
            "mean_reward": scores.mean().item(),
            "pass@1_greedy": (scores >= threshold).double().mean().item(),
            "mean_length": greedy.response_lengths.double().mean().item(),
            "reward_errors": greedy_results.num_errors,
        }
        if samples:
            sampled_out, num_errors = _sampled_metrics(gen, scorer, prompts, items, samples, ks, threshold)
            out.update(sampled_out)
            out["reward_errors"] += num_errors
    finally:
        scorer.close()
    out["threshold"] = threshold
    if isinstance(reward_spec, str) and reward_spec not in BUILTIN_REWARDS:
        out["reward"] = str(reward_spec)
    return out


def _sampled_metrics(
    gen, scorer, prompts: list, items: list, samples: int, ks: Sequence[int], threshold: float
) -> tuple[dict[str, Any], int]:
    """``samples`` sampled responses per prompt: their mean reward and length, and ``pass@K`` for
    each K in ``ks``; and the number of reward errors."""
    import torch

    from ppokit.algo.evaluation import mean_pass_at_k
    from ppokit.lm.evaluate import score_texts

    sampled = gen.engine.generate(prompts, group_size=samples, items=items)
    results = score_texts(scorer, sampled.prompts, sampled.texts, sampled.items)
    sampled_scores = torch.tensor(results.scores, dtype=torch.float64).view(len(items), samples)  # (P, n)
    out: dict[str, Any] = {
        "samples": samples,
        "temperature": gen.engine.cfg.temperature,
        "sampled_mean_reward": sampled_scores.mean().item(),
        "sampled_mean_length": sampled.response_lengths.double().mean().item(),
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
    from ppokit.lm.data.chat import chat_renderer, render_records
    from ppokit.lm.data.sources import is_file_source, load_prompts

    cfg = gen.cfg
    if data is None:
        if cfg is None:
            raise UserError(
                "--data is needed with a model directory: a task (e.g. arithmetic, gsm8k:path=...) or "
                "a JSONL / Parquet file or datasets directory of prompts and answers"
            )
        from ppokit.lm.data.inputs import load_data

        if reward is not None:
            cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"reward": reward})})
        _, items, reward_fn = load_data(cfg, gen.tokenizer, where="the checkpoint")
        if reward_fn is None:
            raise UserError("the run is scored by its reward model alone; give a verifier with --reward")
        if not items:
            raise UserError("the run has no held-out prompts; give them with --data")
        return items, reward_fn.spec
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
        from ppokit.lm.data.tasks import get_task

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


def evaluate_textenv_run(run_dir: str | Path, episodes: int | None = None, *, device: str | None = None) -> dict:
    """A multi-turn run's greedy evaluation (:class:`~ppokit.lm.multi_turn.source.TextEnvEvaluator`) of its
    trained actor: ``{"metrics", "episodes", "message", "checkpoint"}``; ``episodes`` per
    opponent (default: the run's ``textenv.eval_episodes``, else 200)."""
    from ppokit.envs import make_env
    from ppokit.lm.generation.loading import load_generator
    from ppokit.lm.model.checkpoint import POLICY_META_FILE, find_lm_checkpoint
    from ppokit.lm.multi_turn.source import TextEnvEvaluator, check_env_output, engine_generate
    from ppokit.lm.multi_turn.streams import StreamCodec

    ckpt = find_lm_checkpoint(Path(run_dir))
    if ckpt is None:
        raise UserError(f"{run_dir} has no language-model checkpoint (no {POLICY_META_FILE})")
    if episodes is not None and episodes < 1:
        raise UserError(f"--episodes must be at least 1 (got {episodes})")
    gen = load_generator(ckpt, device=device)
    cfg = gen.cfg
    cfg.textenv.eval_episodes = episodes or cfg.textenv.eval_episodes or 200
    probe = make_env(cfg.textenv.env, **cfg.textenv.kwargs)
    name = getattr(probe, "env_name", cfg.textenv.env)
    codec = StreamCodec(
        gen.tokenizer,
        mode=check_env_output(probe, name),
        chat=cfg.data.chat_template,
        where=f"the checkpoint {ckpt}",
        env_name=name,
        stop_ids=gen.engine.eos_ids,
    )
    evaluator = TextEnvEvaluator(cfg, engine_generate(gen.engine), codec, gen.engine.max_positions, name)
    metrics = evaluator.evaluate("periodic")
    return {
        "metrics": metrics,
        "episodes": cfg.textenv.eval_episodes,
        "message": evaluator.message("periodic", metrics),
        "checkpoint": str(ckpt),
    }
