"""The ``ppokit`` command line: parses arguments and dispatches, nothing else.

Imports are lazy: ``ppokit --help`` and ``ppokit config ...`` never import torch.
A :class:`~ppokit.errors.UserError` anywhere below becomes one line on stderr and exit
status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

EXAMPLES = """\
examples:
  ppokit train cartpole                       train with a built-in preset
  ppokit train cartpole seed=3 algo.gamma=0.98   ... with dotted overrides
  ppokit train my_run.yaml train.total_steps=2e5  ... from your own YAML file
  ppokit train --resume runs/cartpole-s3-20261122-101500   continue a stopped run
  ppokit eval runs/cartpole-s3-20261122-101500 --episodes 20
  ppokit eval runs/arith-s1-20261122-101500  greedy held-out accuracy of an LM run
  ppokit eval RUN_DIR --samples 8 --k 1 4 8    ... with sampled pass@k
  ppokit eval MODEL_DIR --data test.jsonl --reward math --json   a model directory on a dataset
  ppokit generate RUN_DIR --prompt "12+30="   sample from the trained actor
  ppokit chat RUN_DIR                         talk to it (chat template, history)
  ppokit reward math --prompt "1/2+0?" --response "\\boxed{0.5}" --field answer=1/2
  ppokit plot runs/a runs/b --out ab.png      training curves of runs, overlaid
  ppokit config show cartpole                 print the resolved configuration
  ppokit config fields                        every field with its default and meaning
"""


SEED_MAX = 2**63 - 1  # = ppokit.config.SEED_MAX (not imported: pydantic would slow `ppokit --help`)


def int_at_least(low: int, high: int | None = None):
    """An argparse type: an int in ``[low, high]``; "invalid int value: 'abc'" for a non-number."""

    def convert(text: str) -> int:
        value = int(text)
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {bound} (got {value})")
        return value

    convert.__name__ = "int"
    return convert


def add_sampling_options(parser: argparse.ArgumentParser, what: str = "the run's rollout settings") -> None:
    """--temperature, --top-p, --top-k, --max-new-tokens, --greedy, --seed, --device."""
    parser.add_argument("--temperature", type=positive_float, default=None, help=f"sampling temperature ({what})")
    parser.add_argument("--top-p", type=positive_float, default=None, help=f"nucleus sampling ({what})")
    parser.add_argument("--top-k", type=int_at_least(0), default=None, help=f"top-k sampling, 0 = off ({what})")
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=None, help=f"response length limit ({what})")
    parser.add_argument("--seed", type=int_at_least(0, SEED_MAX), default=0, help="sampling seed (default 0)")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: the run's, else auto)")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "max_new_tokens": args.max_new_tokens,
        "device": args.device,
    }


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (got {text})")
    return value


positive_float.__name__ = "float"


class Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line and exit status 2."""

    def error(self, message: str):
        command = self.prog.partition(" ")[2]  # "eval" for "ppokit eval", "" for ppokit itself
        where = f"{command}: " if command else ""
        self.exit(2, f"ppokit: error: {where}{message} (see {self.prog} --help)\n")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; KEY=VALUE overrides may also come after options (``train cartpole --name x seed=3``)."""
    args, extra = parser.parse_known_args(argv)
    swallowed = []  # `train CONFIG --resume seed=3`: --resume took the override as its RUN_DIR
    resume = getattr(args, "resume", None)
    if isinstance(resume, str) and "=" in resume and not os.path.exists(resume):
        swallowed, args.resume = [resume], True
    if hasattr(args, "overrides"):
        args.overrides = args.overrides + swallowed + [arg for arg in extra if not arg.startswith("-")]
        extra = [arg for arg in extra if arg.startswith("-")]
    if extra:
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ppokit",
        description="Proximal Policy Optimization for language models and Gymnasium agents.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="train a policy from a preset or YAML config",
        description="Train a policy. CONFIG is a preset name (see `ppokit config list`) "
        "or a YAML file; KEY=VALUE pairs override fields (dotted paths).",
    )
    train.add_argument("config", metavar="CONFIG", nargs="?", help="preset name or path to a YAML file")
    train.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help="e.g. algo.gamma=0.99 seed=3")
    train.add_argument("--output-dir", help="parent directory of the run directory (run.output_dir)")
    train.add_argument("--name", help="run directory name (run.name)")
    train.add_argument("--no-progress", action="store_true", help="no live progress bar")
    train.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="RUN_DIR",
        help="continue a run from its newest checkpoint: `ppokit train CONFIG --resume` resumes "
        "run.output_dir/run.name (run.name must be set); `ppokit train --resume RUN_DIR` "
        "resumes RUN_DIR with its saved config",
    )

    ev = sub.add_parser(
        "eval",
        help="evaluate a trained run's policy, or a model directory on a dataset",
        description="Control run: run the deterministic policy of RUN_DIR's checkpoint and "
        "print the mean and std of the episode return. Language model (a run's "
        "trained actor, or a Hugging Face model directory with --data): the greedy "
        "mean reward, greedy pass@1, sampled pass@k (unbiased estimator, with "
        "--samples N --k K) and the mean response length, as a table or --json; on "
        "a text environment (textenv), its greedy win rates.",
    )
    ev.add_argument(
        "run_dir",
        metavar="RUN_DIR|MODEL_DIR",
        help="a run directory, one of its checkpoint directories, or a language model's directory",
    )
    ev.add_argument(
        "--episodes",
        type=int_at_least(1),
        default=None,
        help="control: episodes to run (default 10); text environment: greedy episodes against each "
        "evaluation opponent (default: the run's textenv.eval_episodes)",
    )
    ev.add_argument(
        "--prompts",
        type=int_at_least(1),
        default=None,
        help="language model: prompts to score (default: all of the held-out set)",
    )
    ev.add_argument(
        "--seed",
        type=int_at_least(0, SEED_MAX),
        default=None,
        help="evaluation seed (control default: the run's seed + 10000; language model: 0)",
    )
    ev.add_argument(
        "--data",
        default=None,
        help="language model: the prompts, a task (its held-out split) or a "
        "JSONL / Parquet file / datasets directory (default: the run's held-out set)",
    )
    ev.add_argument(
        "--reward",
        default=None,
        help="language model: the verifier, a built-in, module:fn or "
        "file.py:fn (default: the run's, or the task's own)",
    )
    ev.add_argument(
        "--samples",
        type=int_at_least(0),
        default=0,
        help="language model: sampled responses per prompt for pass@k (default 0: greedy only)",
    )
    ev.add_argument(
        "--k",
        type=int_at_least(1),
        nargs="+",
        default=None,
        metavar="K",
        help="language model: pass@K for each K (needs --samples >= K; default: 1 and --samples)",
    )
    ev.add_argument(
        "--threshold",
        type=float,
        default=1.0,
        help="language model: a response is correct when its reward is at least this (default 1)",
    )
    ev.add_argument("--prompt-key", default=None, help="language model: the prompt field of --data")
    ev.add_argument("--answer-key", default=None, help="language model: the answer field of --data")
    ev.add_argument(
        "--chat-template",
        action="store_true",
        default=None,
        help="language model: render prompts with the model's chat template (default: as the run did)",
    )
    ev.add_argument(
        "--reward-timeout",
        type=positive_float,
        default=30.0,
        help="language model: seconds per sample before a reward counts as failed (default 30)",
    )
    ev.add_argument("--temperature", type=positive_float, default=None, help="sampling temperature (the run's)")
    ev.add_argument("--top-p", type=positive_float, default=None, help="nucleus sampling (the run's)")
    ev.add_argument("--max-new-tokens", type=int_at_least(1), default=None, help="response length limit (the run's)")
    ev.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: the run's, else auto)")
    ev.add_argument("--json", action="store_true", help="language model: print the result as JSON")

    gen = sub.add_parser(
        "generate",
        help="generate from a trained actor or a model directory",
        description="Answer each --prompt (or each line of standard input) with the trained "
        "actor of RUN_DIR (its LoRA adapter applied) or a Hugging Face model "
        "directory, through ppokit's generation path.",
    )
    gen.add_argument("path", metavar="RUN_DIR|MODEL_DIR")
    gen.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a prompt (repeat for several; default: one per line of standard input)",
    )
    gen.add_argument("--num-samples", type=int_at_least(1), default=1, help="responses per prompt (default 1)")
    gen.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    gen.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap each prompt as a user message in the chat template (default: as the run did)",
    )
    gen.add_argument("--system", default=None, help="a system message (with the chat template)")
    add_sampling_options(gen)

    chat = sub.add_parser(
        "chat",
        help="chat with a trained actor or a model directory",
        description="Read messages from standard input, one per line, and answer with the "
        "conversation rendered by the model's chat template. Commands: /clear, "
        "/set KEY=VALUE (temperature, top_p, top_k, max_new_tokens), /help, /exit.",
    )
    chat.add_argument("path", metavar="RUN_DIR|MODEL_DIR")
    chat.add_argument("--system", default=None, help="a system message that opens the conversation")
    chat.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    add_sampling_options(chat)

    reward = sub.add_parser(
        "reward",
        help="score one response with a reward function (debug a verifier)",
        description="Run the reward function NAME on one prompt and response as training "
        "does (in a worker process with a time limit, except the cheap built-ins) "
        "and print the score and, when there is one, the reason for it or the "
        "failure. Exit status 0 when scored, 2 for bad arguments.",
    )
    reward.add_argument(
        "name",
        metavar="NAME",
        help="a built-in (exact_match, numeric_match, math, code, countdown), module:fn or file.py:fn",
    )
    reward.add_argument("--prompt", required=True, metavar="TEXT")
    reward.add_argument("--response", required=True, metavar="TEXT")
    reward.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a data field for the function (JSON values are parsed: --field tests='[...]')",
    )
    reward.add_argument("--timeout", type=positive_float, default=30.0, help="seconds before it counts as hung")

    demo = sub.add_parser(
        "demo",
        help="a built-in demonstration run (arith: SFT, then PPO with a verifier; "
        "tictactoe: multi-turn PPO against a random player)",
        description="Build the built-in tiny Llama, warm-start it, then train it with PPO. "
        "ppokit demo (arith): worked two-digit additions, then an exact-match "
        "reward; prints the held-out accuracy before and after PPO. ppokit demo "
        "tictactoe: random legal games, then multi-turn PPO against a random "
        "player; prints the illegal-move rate and the win rate before and after. "
        "Both draw the reward curve. KEY=VALUE pairs override fields of the preset.",
    )
    demo.add_argument(
        "overrides",
        nargs="*",
        default=[],
        metavar="[NAME] KEY=VALUE",
        help="the demo (arith, tictactoe, frozenlake; default arith), then overrides, e.g. "
        "train.iterations=5 seed=2 run.output_dir=/tmp/runs run.progress=false",
    )

    sft = sub.add_parser(
        "sft",
        help="supervised warm start of a language model (before PPO)",
        description="Fine-tune a causal LM on worked examples (loss on the answer and EOS) "
        "until held-out accuracy stops improving; save the best model to --out.",
    )
    sft.add_argument(
        "prompts",
        metavar="TASK_OR_JSONL",
        help="a built-in task (arithmetic, arithmetic:digits=3) or a JSONL file with prompt + completion per line",
    )
    sft.add_argument("--out", required=True, help="directory for the fine-tuned model (new or empty)")
    sft.add_argument("--model", default="tiny", help="model directory, or tiny (the built-in tiny Llama)")
    sft.add_argument(
        "--examples", type=int_at_least(1), default=None, help="number of training examples (task default 300)"
    )
    sft.add_argument("--eval-prompts", default=None, help="held-out JSONL (required with a JSONL training file)")
    sft.add_argument(
        "--eval-size", type=int_at_least(1), default=256, help="held-out problems to evaluate (default 256)"
    )
    sft.add_argument("--reward", default=None, help="exact_match, numeric_match, module:fn or file.py:fn")
    sft.add_argument("--epochs-max", type=int_at_least(1), default=300)
    sft.add_argument("--batch-size", type=int_at_least(1), default=32)
    sft.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate (default 1e-3)")
    sft.add_argument(
        "--patience", type=int_at_least(1), default=8, help="evaluations without improvement before stopping"
    )
    sft.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    sft.add_argument("--seed", type=int_at_least(0, SEED_MAX), default=0)
    sft.add_argument(
        "--chat-template",
        action="store_true",
        help="render the prompts with the model's chat template (as data.chat_template)",
    )

    plot = sub.add_parser(
        "plot",
        help="draw the training curves of one or more runs into a PNG",
        description="Read RUN_DIR/metrics.jsonl of each run and draw return (or reward), KL, "
        "entropy, value loss, clip fraction and explained variance, runs "
        "overlaid. Default output: RUN_DIR/curves.png for one run, "
        "./curves.png for several.",
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument(
        "--out",
        default=None,
        metavar="FILE.png",
        help="output PNG (default RUN_DIR/curves.png, or ./curves.png for several runs)",
    )

    export = sub.add_parser(
        "export",
        help="merge a trained LM's actor into a standalone model directory",
        description="Write the trained actor (LoRA merged into the backbone) and the "
        "tokenizer to OUT, loadable by AutoModelForCausalLM.from_pretrained.",
    )
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("out_dir", metavar="OUT")

    cfg = sub.add_parser("config", help="show, list and explain configurations")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="ACTION")
    show = cfg_sub.add_parser("show", help="print the resolved config of a preset or YAML file")
    show.add_argument("config", metavar="NAME", help="preset name or YAML path")
    show.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE")
    cfg_sub.add_parser("list", help="list the built-in presets")
    cfg_sub.add_parser("fields", help="every config field with its default, aliases and description")
    for command_parser in [*sub.choices.values(), *cfg_sub.choices.values()]:
        command_parser.set_defaults(command_parser=command_parser)  # whose usage an error names
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    from ppokit.errors import Interrupted, UserError

    try:
        return _dispatch(parser, args)
    except UserError as exc:
        print(f"ppokit: error: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:  # SIGINT/SIGTERM during training: a checkpoint was saved
        print(f"ppokit: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ppokit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ppokit config fields | head`: the reader left, nothing to report
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.version:
        from ppokit import __version__

        print(__version__)
        return 0
    if args.command == "train":
        extra = list(args.overrides)
        # quoted: the value is a string as given (--name 2024, --name yes), and --name "" is an error
        if args.output_dir is not None:
            extra.append(f"run.output_dir={json.dumps(args.output_dir)}")
        if args.name is not None:
            extra.append(f"run.name={json.dumps(args.name)}")
        if args.no_progress:
            extra.append("run.progress=false")
        return _train(args.config, extra, resume=args.resume)
    if args.command == "demo":
        return _demo(args.overrides)
    if args.command == "eval":
        return _eval(args)
    if args.command == "generate":
        from ppokit.commands.interactive import generate_main

        return generate_main(
            args.path,
            args.prompt,
            chat_template=args.chat_template,
            system=args.system,
            num_samples=args.num_samples,
            greedy=args.greedy,
            seed=args.seed,
            **sampling_kwargs(args),
        )
    if args.command == "chat":
        from ppokit.commands.interactive import chat_main

        return chat_main(args.path, system=args.system, greedy=args.greedy, seed=args.seed, **sampling_kwargs(args))
    if args.command == "reward":
        from ppokit.commands.reward import reward_main

        score, reason = reward_main(args.name, args.prompt, args.response, args.field, timeout=args.timeout)
        print(f"score: {score:g}")
        if reason:
            print(f"reason: {reason}")
        return 0
    if args.command == "sft":
        return _sft(args)
    if args.command == "plot":
        from ppokit.plot import plot_runs

        print(f"curves: {plot_runs(args.run_dirs, args.out)['out']}")
        return 0
    if args.command == "export":
        from ppokit.commands.export import export_merged

        print(f"exported to {export_merged(args.run_dir, args.out_dir)}")
        return 0
    if args.command == "config":
        return _config(args)
    parser.print_help()
    return 0


def _train(source: str | None, overrides: list[str], resume: bool | str | None = None) -> int:
    from ppokit import rundir

    try:
        return _train_locked(source, overrides, resume)
    finally:
        rundir.release_locks()  # the run directory is free again, whatever happened


def _train_locked(source: str | None, overrides: list[str], resume: bool | str | None) -> int:
    from ppokit import rundir
    from ppokit.config import load_config
    from ppokit.errors import UserError
    from ppokit.workloads import check_inputs, train

    if isinstance(resume, str):  # ppokit train --resume RUN_DIR [KEY=VALUE ...]: the run's own config
        cfg, run_dir, resume_from = rundir.open_run_for_resume(resume, ([source] if source else []) + overrides)
        check_inputs(cfg)
    else:
        if source is None:
            raise UserError("ppokit train needs CONFIG (a preset or YAML file), or --resume RUN_DIR")
        cfg = load_config(source, overrides)
        check_inputs(cfg)  # fail on a bad env id or model path before a run directory exists
        run_dir, resume_from = rundir.prepare_run_dir(cfg, required=resume is True)  # locked from here on
    print(f"run directory: {run_dir}" + (f" (resuming from {resume_from})" if resume_from else ""), flush=True)
    result = train(cfg, run_dir, resume_from)
    if result.get("already_finished"):
        print(f"run {run_dir} had already finished ({result['iterations']} iterations): nothing to do")
        return 0
    _write_curves(run_dir)
    if "eval_return_mean" in result:
        print(
            f"deterministic eval: return {result['eval_return_mean']:.1f} +- {result.get('eval_return_std', 0.0):.1f}"
        )
    if "eval_accuracy_after" in result:
        print(
            f"held-out accuracy: {result['eval_accuracy_before']:.1%} before, {result['eval_accuracy_after']:.1%} after"
        )
    return 0


def _write_curves(run_dir) -> None:
    """RUN_DIR/curves.png after a run; a plotting failure is a warning, never a lost run."""
    try:
        from ppokit.plot import plot_runs

        print(f"curves: {plot_runs([run_dir])['out']}", flush=True)
    except Exception as exc:  # noqa: BLE001 - the run and its checkpoint are already saved
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(
            f"ppokit: warning: could not draw {run_dir}/curves.png ({text}); `ppokit plot {run_dir}` retries",
            file=sys.stderr,
        )


def _sft(args: argparse.Namespace) -> int:
    from ppokit.commands.sft import sft_main

    summary = sft_main(
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
    print(f"held-out accuracy after SFT: {summary['best_accuracy']:.1%} (curve: {args.out}/sft_curve.json)")
    return 0


def _demo(overrides: list[str]) -> int:
    """A demo preset (arith by default: SFT warm start, then PPO); ends with ``held-out accuracy: X% -> Y%``
    (arith) or ``win rate vs random: X% -> Y%`` (tictactoe)."""
    from ppokit.commands.demo import DEMO_PRESET, run_demo

    name = DEMO_PRESET
    if overrides and "=" not in overrides[0]:
        name, overrides = overrides[0], overrides[1:]
    run_demo(overrides, name=name)
    return 0


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


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ppokit.rundir import evaluation_checkpoint, saved_config

    path = Path(args.run_dir)
    is_model_dir = path.is_dir() and (path / "config.json").is_file()
    ckpt = evaluation_checkpoint(path) if path.is_dir() else None
    saved = (saved_config(ckpt) if ckpt is not None else None) or {}
    is_lm_run = saved.get("workload") == "lm"
    if is_lm_run and (saved.get("textenv") or {}).get("env") is not None:  # a multi-turn run
        from ppokit.commands.evaluate import evaluate_textenv_run

        result = evaluate_textenv_run(path, args.episodes, device=args.device)
        print(f"{result['message']} ({result['checkpoint']})")
        return 0
    if path.is_dir() and (is_lm_run or is_model_dir):
        from ppokit.commands.evaluate import evaluate_lm, format_eval_table

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
        from ppokit.errors import UserError

        raise UserError(
            f"{args.run_dir} is not a language-model run or model directory, and {', '.join(given)} "
            "apply to language models only"
        )
    from ppokit.control.evaluate import evaluate_run

    episodes = args.episodes or 10
    mean, std = evaluate_run(args.run_dir, episodes, seed=args.seed)
    print(f"return over {episodes} episodes: {mean:.2f} +- {std:.2f}")
    return 0


def _config(args: argparse.Namespace) -> int:
    from ppokit import config as config_mod
    from ppokit.workloads import describe, workload_kind

    if args.config_command == "show":
        print(config_mod.load_config(args.config, args.overrides).to_yaml(), end="")
    elif args.config_command == "list":
        for name in config_mod.preset_names():
            cfg = config_mod.load_config(name)
            print(f"{name:14s} {workload_kind(cfg):8s} {describe(cfg)}")
    elif args.config_command == "fields":
        for path, default, aliases, description in config_mod.describe_fields():
            alias_text = f"  (aliases: {aliases})" if aliases else ""
            print(f"{path} = {default}\n    {description}{alias_text}")
    else:
        print("usage: ppokit config {show NAME,list,fields}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
