"""One benchmark at two git revisions, alternately, in one invocation: the ratios of its figures.

Timings on a shared machine drift by minutes and move 2-10x between runs, so a figure is
only comparable with one taken beside it. This script checks out each revision into a
temporary worktree and runs the same command in each, in the order A B B A (repeated
``--rounds`` times), so that a drift of the host's load falls on both sides alike. The
command writes its figures as JSON to the path that replaces ``{json}`` in it; every
numeric leaf of that JSON (``a.b.c`` for nested keys, list items by index) is reported
as the median over the runs of each side and the ratio B / A. A command without ``{json}``
prints its JSON as the last line of its output instead (``bench/lm.py --child perf`` does,
at every revision)::

    python bench/compare.py main HEAD -- python bench/control.py --only ppokit --seeds 1 2 3 --json {json}
    python bench/compare.py main HEAD --rounds 1 -- python bench/lm.py --threads 1 --only perf --json {json}
    python bench/compare.py main HEAD -- python bench/lm.py --threads 1 --child perf

The command runs in the worktree with ``PYTHONPATH`` set to it, so each side imports its
own ppokit; the virtual environment (the Python that runs this script) is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def leaves(value, prefix: str = "") -> dict[str, float]:
    """Every number in ``value`` (a JSON document) by its dotted path."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, (int, float)):
        return {prefix: float(value)}
    out: dict[str, float] = {}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        out.update(leaves(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def worktree(rev: str, where: Path) -> Path:
    """A detached checkout of ``rev`` under ``where``."""
    path = where / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), rev], check=True)
    return path


def run(command: list[str], tree: Path, out: Path) -> dict[str, float]:
    argv = [part.replace("{json}", str(out)) for part in command]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    if not any("{json}" in part for part in command):
        if proc.returncode != 0:
            sys.exit(f"{shlex.join(argv)} failed in {tree}:\n{proc.stderr[-3000:]}")
        return leaves(json.loads(proc.stdout.strip().splitlines()[-1]))
    if not out.is_file():  # (a bench that misses a goal exits 1 but still writes its figures)
        sys.exit(f"{shlex.join(argv)} wrote no {out} in {tree} (exit status {proc.returncode}):\n{proc.stderr[-3000:]}")
    return leaves(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        sys.exit("usage: compare.py REV_A REV_B [--rounds N] -- COMMAND ... {json} ...")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev_a")
    p.add_argument("rev_b")
    p.add_argument("--rounds", type=int, default=1, help="ABBA rounds (default 1: each side runs twice)")
    a = p.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    with tempfile.TemporaryDirectory(prefix="ppokit-compare-") as tmp:
        where = Path(tmp)
        trees = {"A": worktree(a.rev_a, where), "B": worktree(a.rev_b, where)}
        try:
            results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
            for r in range(a.rounds):
                for i, side in enumerate("ABBA"):
                    print(f"round {r + 1}/{a.rounds}, run {i + 1}/4: {side}", file=sys.stderr, flush=True)
                    results[side].append(run(command, trees[side], where / f"{side}-{r}-{i}.json"))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    keys = [k for k in results["A"][0] if all(k in run_ for run_ in results["A"] + results["B"])]
    width = max((len(k) for k in keys), default=10)
    print(f"{'figure':<{width}}  {a.rev_a:>12}  {a.rev_b:>12}  B / A   (medians of {2 * a.rounds} runs each)")
    for key in keys:
        med_a = statistics.median(run_[key] for run_ in results["A"])
        med_b = statistics.median(run_[key] for run_ in results["B"])
        ratio = f"{med_b / med_a:6.3f}" if med_a else "   n/a"
        print(f"{key:<{width}}  {med_a:12.4g}  {med_b:12.4g}  {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
