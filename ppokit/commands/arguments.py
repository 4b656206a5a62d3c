"""What the commands' parsers share: argument types, the sampling options, the one-line usage error.

Nothing heavy is imported here: every command adds its parser at start-up, ``ppokit --help``
included.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

SEED_MAX = 2**63 - 1  # = ppokit.config.SEED_MAX (not imported: pydantic would slow `ppokit --help`)


class Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line and exit status 2."""

    def error(self, message: str):
        command = self.prog.partition(" ")[2]  # "eval" for "ppokit eval", "" for ppokit itself
        where = f"{command}: " if command else ""
        self.exit(2, f"ppokit: error: {where}{message} (see {self.prog} --help)\n")


def add_command(
    subparsers: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], int] | None, **kwargs
) -> argparse.ArgumentParser:
    """``subparsers.add_parser(name, **kwargs)``, whose parsed arguments carry ``run`` (what the
    command runs: ``run(args)`` -> exit status) and ``command_parser`` (whose usage an error names)."""
    parser = subparsers.add_parser(name, **kwargs)
    parser.set_defaults(command_parser=parser)
    if run is not None:
        parser.set_defaults(run=run)
    return parser


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


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (got {text})")
    return value


positive_float.__name__ = "float"


def probability(text: str) -> float:
    """An argparse type: a float in (0, 1] (``--top-p``: the share of probability kept)."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1] (got {text})")
    return value


probability.__name__ = "float"


def add_sampling_options(parser: argparse.ArgumentParser, what: str = "the run's rollout settings") -> None:
    """--temperature, --top-p, --top-k, --max-new-tokens, --seed, --device."""
    parser.add_argument("--temperature", type=positive_float, default=None, help=f"sampling temperature ({what})")
    parser.add_argument("--top-p", type=probability, default=None, help=f"nucleus sampling ({what})")
    parser.add_argument("--top-k", type=int_at_least(0), default=None, help=f"top-k sampling, 0 = off ({what})")
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=None, help=f"response length limit ({what})")
    parser.add_argument("--seed", type=int_at_least(0, SEED_MAX), default=0, help="sampling seed (default 0)")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: the run's, else auto)")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The options of :func:`add_sampling_options` but ``--seed``, as keyword arguments."""
    return {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "max_new_tokens": args.max_new_tokens,
        "device": args.device,
    }
