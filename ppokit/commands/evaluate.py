"""``ppokit eval``: a control run's return; for a language model, mean reward, greedy pass@1,
sampled pass@k, mean length; for a multi-turn run, its greedy win rates.

:func:`run` reads RUN_DIR once (:class:`ppokit.persistence.rundir.RunDir`) and hands it to the evaluation of
its workload kind (:func:`ppokit.workloads.evaluate_run`): :mod:`ppokit.control.evaluate`,
:mod:`ppokit.lm.run_eval` (a language-model run or a model directory) or
:mod:`ppokit.lm.multi_turn.run_eval`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ppokit.commands.arguments import SEED_MAX, add_command, int_at_least, positive_float, probability

# the command's options by name: each is None unless given, and the run's kind says which it reads
EVAL_OPTIONS = (
    *("episodes", "prompts", "seed", "data", "reward", "samples", "k", "threshold", "prompt_key", "answer_key"),
    *("chat_template", "reward_timeout", "temperature", "top_p", "max_new_tokens", "device", "json"),
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
        help="a run directory, one of its checkpoint directories, or a language model's directory or GGUF file",
    )
    parser.add_argument(
        "--episodes",
        type=int_at_least(1),
        default=None,
        help="control: episodes to run (default 10); text environment: episodes (textenv.eval_sampling) against each "
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
    parser.add_argument("--top-p", type=probability, default=None, help="nucleus sampling (the run's)")
    parser.add_argument(
        "--max-new-tokens", type=int_at_least(1), default=None, help="response length limit (the run's)"
    )
    parser.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: the run's, else auto)")
    parser.add_argument("--json", action="store_true", default=None, help="language model: print the result as JSON")


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
        default=None,
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
        default=None,
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
        default=None,
        help="language model: seconds per sample before a reward counts as failed (default 30)",
    )


def run(args: argparse.Namespace) -> int:
    """The evaluation of RUN_DIR's workload kind, with the options given (each left at None when
    not given: an option its kind does not read is refused, :func:`ppokit.workloads.evaluate_run`)."""
    from ppokit.lm.model.gguf import model_directory
    from ppokit.persistence.rundir import RunDir
    from ppokit.workloads import evaluate_run

    options = {name: getattr(args, name) for name in EVAL_OPTIONS}
    # a GGUF file (or a packaged model's name) is evaluated as its converted model directory
    path = args.run_dir if Path(args.run_dir).is_dir() else model_directory(args.run_dir, "the model file")
    print(evaluate_run(RunDir(path), **options))
    return 0
