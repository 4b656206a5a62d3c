"""``ppokit plot``: the training curves of one or more runs, overlaid, in a PNG (:mod:`ppokit.monitoring.plot`)."""

from __future__ import annotations

import argparse

from ppokit.commands.arguments import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "plot",
        run,
        help="draw the training curves of one or more runs into a PNG",
        description="Read RUN_DIR/metrics.jsonl of each run and draw return (or reward), KL, "
        "entropy, value loss, clip fraction and explained variance, runs "
        "overlaid. Default output: RUN_DIR/curves.png for one run, "
        "./curves.png for several.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument(
        "--out",
        default=None,
        metavar="FILE.png",
        help="output PNG (default RUN_DIR/curves.png, or ./curves.png for several runs)",
    )


def run(args: argparse.Namespace) -> int:
    from ppokit.monitoring.plot import plot_runs

    print(f"curves: {plot_runs(args.run_dirs, args.out)['out']}")
    return 0
