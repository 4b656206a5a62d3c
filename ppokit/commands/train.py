"""``ppokit train``: train from a preset or YAML config, or resume a run directory.

:func:`run_training` loads the config, prepares (or reopens) the run directory, trains
through :func:`ppokit.workloads.train`, draws ``RUN_DIR/curves.png`` and prints the line that
sums up the run (:func:`ppokit.workloads.summary_line`).
"""

from __future__ import annotations

import argparse
import json
import sys

from ppokit.commands.arguments import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "train",
        run,
        help="train a policy from a preset or YAML config",
        description="Train a policy. CONFIG is a preset name (see `ppokit config list`) "
        "or a YAML file; KEY=VALUE pairs override fields (dotted paths).",
    )
    parser.add_argument("config", metavar="CONFIG", nargs="?", help="preset name or path to a YAML file")
    parser.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE", help="e.g. algo.gamma=0.99 seed=3")
    parser.add_argument("--output-dir", help="parent directory of the run directory (run.output_dir)")
    parser.add_argument("--name", help="run directory name (run.name)")
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="RUN_DIR",
        help="continue a run from its newest checkpoint: `ppokit train CONFIG --resume` resumes "
        "run.output_dir/run.name (run.name must be set); `ppokit train --resume RUN_DIR` "
        "resumes RUN_DIR with its saved config",
    )


def run(args: argparse.Namespace) -> int:
    extra = list(args.overrides)
    # quoted: the value is a string as given (--name 2024, --name yes), and --name "" is an error
    if args.output_dir is not None:
        extra.append(f"run.output_dir={json.dumps(args.output_dir)}")
    if args.name is not None:
        extra.append(f"run.name={json.dumps(args.name)}")
    if args.no_progress:
        extra.append("run.progress=false")
    return run_training(args.config, extra, resume=args.resume)


def run_training(source: str | None, overrides: list[str], resume: bool | str | None = None) -> int:
    from ppokit.persistence import rundir

    try:
        return _train_locked(source, overrides, resume)
    finally:
        rundir.release_locks()  # the run directory is free again, whatever happened


def _train_locked(source: str | None, overrides: list[str], resume: bool | str | None) -> int:
    from ppokit.config import load_config
    from ppokit.errors import UserError
    from ppokit.persistence import rundir
    from ppokit.workloads import check_inputs, summary_line, train

    if isinstance(resume, str):  # ppokit train --resume RUN_DIR [KEY=VALUE ...]: the run's own config
        cfg, run_dir, resume_from = rundir.open_run_for_resume(resume, ([source] if source else []) + overrides)
        workload = check_inputs(cfg)
    else:
        if source is None:
            raise UserError("ppokit train needs CONFIG (a preset or YAML file), or --resume RUN_DIR")
        cfg = load_config(source, overrides)
        if resume is True:  # a run that cannot be resumed: one line before the inputs are read
            rundir.check_resume_target(cfg)
        workload = check_inputs(cfg)  # fail on a bad env id or model path before a run directory exists
        run_dir, resume_from = rundir.prepare_run_dir(cfg, required=resume is True)  # locked from here on
    print(f"run directory: {run_dir}" + (f" (resuming from {resume_from})" if resume_from else ""), flush=True)
    try:
        result = train(cfg, run_dir, resume_from, workload=workload)  # built from what the check read
    except UserError:  # bad input found at the start (a model that fails to load): no empty run left behind
        if resume_from is None and rundir.discard_unstarted(run_dir):
            print(f"run directory {run_dir} removed: the run did not start", flush=True)
        raise
    if result.get("already_finished"):
        print(f"run {run_dir} had already finished ({result['iterations']} iterations): nothing to do")
        return 0
    write_curves(run_dir)
    summary = summary_line(cfg, result)  # the workload kind's final evaluation, when it ran
    if summary:
        print(summary)
    return 0


def write_curves(run_dir) -> None:
    """RUN_DIR/curves.png after a run; a plotting failure is a warning, never a lost run."""
    try:
        from ppokit.monitoring.plot import plot_runs

        print(f"curves: {plot_runs([run_dir])['out']}", flush=True)
    except Exception as exc:  # noqa: BLE001 - the run and its checkpoint are already saved
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(
            f"ppokit: warning: could not draw {run_dir}/curves.png ({text}); `ppokit plot {run_dir}` retries",
            file=sys.stderr,
        )
