"""``ppokit sft``: the supervised warm start alone, on a built-in task or the user's files.

:func:`sft_main` resolves the data, the reward and the model by name, then runs
:func:`ppokit.lm.sft.run_sft`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ppokit.commands.arguments import SEED_MAX, add_command, int_at_least, positive_float
from ppokit.errors import UserError
from ppokit.persistence.signals import handlers_restored


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "sft",
        run,
        help="supervised warm start of a language model (before PPO)",
        description="Fine-tune a causal LM on worked examples (loss on the answer and EOS) "
        "until held-out accuracy stops improving; save the best model to --out.",
    )
    parser.add_argument(
        "prompts",
        metavar="TASK_OR_JSONL",
        help="a built-in task (arithmetic, arithmetic:digits=3) or a JSONL file with prompt + completion per line",
    )
    parser.add_argument("--out", required=True, help="directory for the fine-tuned model (new or empty)")
    parser.add_argument("--model", default="tiny", help="model directory, or tiny (the built-in tiny Llama)")
    parser.add_argument(
        "--examples", type=int_at_least(1), default=None, help="number of training examples (task default 300)"
    )
    parser.add_argument("--eval-prompts", default=None, help="held-out JSONL (required with a JSONL training file)")
    parser.add_argument(
        "--eval-size", type=int_at_least(1), default=256, help="held-out problems to evaluate (default 256)"
    )
    parser.add_argument("--reward", default=None, help="exact_match, numeric_match, module:fn or file.py:fn")
    parser.add_argument("--epochs-max", type=int_at_least(1), default=300)
    parser.add_argument("--batch-size", type=int_at_least(1), default=32)
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument(
        "--patience", type=int_at_least(1), default=8, help="evaluations without improvement before stopping"
    )
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--seed", type=int_at_least(0, SEED_MAX), default=0)
    parser.add_argument(
        "--chat-template",
        action="store_true",
        help="render the prompts with the model's chat template (as data.chat_template)",
    )


def run(args: argparse.Namespace) -> int:
    with sigterm_as_ctrl_c():  # a scheduler's stop ends the training as Ctrl-C does: the best model is kept
        summary = _run(args)
    print(f"held-out accuracy after SFT: {summary['best_accuracy']:.1%} (curve: {args.out}/sft_curve.json)")
    return 0


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM raises ``KeyboardInterrupt`` in the block, as Ctrl-C's SIGINT does (the main thread only)."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    with handlers_restored((signal.SIGTERM,), install=interrupt):
        yield


def _run(args: argparse.Namespace) -> dict[str, Any]:
    return sft_main(
        args.prompts,
        args.out,
        model=args.model,
        examples=args.examples,
        eval_prompts=args.eval_prompts,
        eval_size=args.eval_size,
        reward=args.reward,
        seed=args.seed,
        chat_template=args.chat_template,
        epochs_max=args.epochs_max,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        patience=args.patience,
        precision=args.precision,
    )


def sft_main(
    prompts: str,
    out_dir: str | os.PathLike,
    *,
    model: str = "tiny",
    examples: int | None = None,
    eval_prompts: str | None = None,
    eval_size: int = 256,
    reward: str | None = None,
    seed: int = 0,
    chat_template: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """What ``ppokit sft`` runs: resolve data, reward and model by name, then :func:`run_sft`.

    ``prompts``: a built-in task (``arithmetic:digits=2``; its ``sft`` split trains, its
    ``eval`` split is held out) or a JSONL file with ``prompt`` + ``completion`` per line
    (then ``eval_prompts``, a JSONL file, is required). ``examples``: how many (default:
    300 of a task, all of a file). ``model``: ``tiny`` (the built-in
    model, randomly initialised with ``seed``; its random init is not kept) or a model
    directory. ``reward``: scores the held-out answers (default: the task's own).
    ``chat_template``: render the prompts with the model's chat template, as
    ``data.chat_template`` (:mod:`ppokit.lm.data.chat`; not for the tiny model, which has none).
    ``options``: :class:`~ppokit.lm.sft.SFTSettings` fields (``epochs_max``, ``batch_size``,
    ``learning_rate``, ``patience``, ``precision``, ``device``, ...), and :func:`run_sft`'s ``log``
    and ``overwrite``.
    """
    from ppokit.lm.data.chat import model_chat_renderer, render_records
    from ppokit.lm.data.sources import is_file_source, load_prompts
    from ppokit.lm.data.tasks import get_task
    from ppokit.lm.rewards.functions import load_reward_fn

    for flag, value in (("--examples", examples), ("--eval-size", eval_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(f"sft {flag} must be a positive integer (got {value!r})")
    from_file = is_file_source(prompts)
    if reward is None:
        if from_file:
            raise UserError(
                f"the SFT data {prompts} is a file: name a reward function to score the held-out "
                "answers (exact_match, numeric_match, module:fn or file.py:fn)"
            )
        reward = get_task(prompts).default_reward
    reward_fn = load_reward_fn(reward)
    if from_file and eval_prompts is None:
        raise UserError(
            f"SFT on the file {prompts} needs held-out prompts to pick the best model: "
            "give an eval JSONL file (eval_prompts)"
        )
    train = load_prompts(prompts, "sft", n=examples if examples is not None or from_file else 300, chat=chat_template)
    held_out = (
        load_prompts(eval_prompts, "eval", chat=chat_template)[:eval_size]
        if eval_prompts is not None
        else load_prompts(prompts, "eval", n=eval_size)
    )
    if chat_template:
        render = model_chat_renderer(
            model, what="--model", option="--chat-template", fix="give --model a chat model's directory"
        )
        train, held_out = render_records(train, render), render_records(held_out, render)
    # the model's modules (torch, transformers) once the data and the reward are known good
    from ppokit.lm.model.tiny import build_tiny_model
    from ppokit.lm.sft import SFTSettings, run_sft

    log, overwrite = options.pop("log", print), options.pop("overwrite", False)
    settings = SFTSettings(seed=seed, **options)
    if model != "tiny":
        return run_sft(model, out_dir, train, held_out, settings, reward_fn=reward_fn, log=log, overwrite=overwrite)
    with tempfile.TemporaryDirectory(prefix="ppokit-tiny-") as tmp:
        init = build_tiny_model(Path(tmp) / "init", seed=seed)
        summary = run_sft(init, out_dir, train, held_out, settings, reward_fn=reward_fn, log=log, overwrite=overwrite)
    summary["settings"]["model_dir"] = "tiny"
    return summary
