"""The ``ppokit`` command line: registers the commands of :mod:`ppokit.commands` and runs one.

Each command module adds its parser (``add_parser``) and names what runs it (``args.run``).
Imports are lazy: ``ppokit --help`` and ``ppokit config ...`` never import torch.
A :class:`~ppokit.errors.UserError` anywhere below becomes one line on stderr and exit
status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from ppokit.commands import config, demo, evaluate, export, interactive, plot, reward, sft, train
from ppokit.commands.arguments import Parser

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

# in the order `ppokit --help` lists them (interactive: generate and chat)
COMMANDS = (train, evaluate, interactive, reward, demo, sft, plot, export, config)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; KEY=VALUE overrides may also come after options (``train cartpole --name x seed=3``)."""
    args, extra = parser.parse_known_args(argv)
    swallowed = []  # `train CONFIG --resume seed=3`: --resume took the override as its RUN_DIR
    if isinstance(args.resume, str) and "=" in args.resume and not os.path.exists(args.resume):
        swallowed, args.resume = [args.resume], True
    if args.overrides is not None:  # a command that takes KEY=VALUE overrides
        args.overrides = args.overrides + swallowed + [arg for arg in extra if not arg.startswith("-")]
        extra = [arg for arg in extra if arg.startswith("-")]
    if extra:
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ppokit",
        description="Proximal Policy Optimization for language models and Gymnasium agents.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    # what every command's arguments carry; a command's own parser sets those it has
    parser.set_defaults(run=None, command_parser=parser, resume=None, overrides=None)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
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
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.version:
        from ppokit import __version__

        print(__version__)
        return 0
    if args.run is None:
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
