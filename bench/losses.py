"""Does each policy loss train? CartPole and the arith demo, every registered loss, one invocation.

- ``cartpole``: the cartpole preset with ``algo.loss_mode=NAME`` on each seed, stopped at a
  periodic evaluation of 490 (or the preset's 100k steps): the environment steps it took and
  the final deterministic return (solved: >= 475, CartPole-v1's threshold).
- ``arith``: one warm start (the arith preset's, stopped after one iteration), then each loss
  for ``--iterations`` PPO iterations from it: the held-out greedy accuracy before and after.

    python bench/losses.py --part cartpole --seeds 1 2 3
    python bench/losses.py --part arith --iterations 60 --json /tmp/losses.json

Losses whose own hyperparameters need a value (dro: ``algo.dro_beta``) get the one in
:data:`EXTRA`; GSPO and the rest run at the preset's settings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ppokit.algo import POLICY_LOSSES  # noqa: E402

EXTRA = {"dro": ["algo.dro_beta=0.1"]}
SOLVED = 475.0  # CartPole-v1's reward threshold


def train(args: list[str], out: Path, name: str) -> tuple[list[dict], float, str]:
    """``ppokit train ARGS`` in a subprocess: its metrics rows, its wall time and its output."""
    cmd = [sys.executable, "-m", "ppokit", "train", *args, "run.progress=false", "run.tensorboard=false"]
    cmd += ["--output-dir", str(out), "--name", name]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    path = out / name / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows, time.perf_counter() - start, proc.stdout


def cartpole(a: argparse.Namespace, out: Path) -> dict:
    result = {}
    for loss in a.losses:
        runs = []
        for seed in a.seeds:
            rows, wall, _ = train(
                ["cartpole", f"seed={seed}", f"algo.loss_mode={loss}", "env.eval_every=5", "env.stop_at_return=490"]
                + EXTRA.get(loss, []),
                out,
                f"cartpole_{loss}_{seed}",
            )
            final = rows[-1]["eval_return_mean"]  # the deterministic evaluation after training
            solved = final >= SOLVED
            steps = rows[-1]["global_step"]
            runs.append({"seed": seed, "steps": steps, "final_return": final, "solved": solved, "seconds": wall})
            print(
                f"cartpole {loss:<9} seed {seed}: {steps} steps, final return {final:.1f}",
                "(solved)" if solved else "(NOT solved)",
            )
        result[loss] = runs
    return result


def arith(a: argparse.Namespace, out: Path) -> dict:
    train(["arith", f"seed={a.seed}", "train.iterations=1"], out, "warm")
    base = out / "warm" / "base_model"
    common = ["arith", f"seed={a.seed}", f"model.path={base}", "data.sft_epochs=0", f"train.iterations={a.iterations}"]
    common += ["data.stop_at_accuracy=null", "data.eval_every=0"]
    result = {}
    for loss in a.losses:
        rows, wall, stdout = train(common + [f"algo.loss_mode={loss}"] + EXTRA.get(loss, []), out, f"arith_{loss}")
        # the CLI's last line: "held-out accuracy: 36.7% before, 52.0% after"
        before = float(re.search(r"held-out accuracy: ([0-9.]+)% before", stdout).group(1)) / 100
        after = rows[-1]["eval_accuracy_after"]
        result[loss] = {"before": before, "after": after, "seconds": wall, "iterations": len(rows)}
        print(f"arith {loss:<9}: held-out {before:.3f} -> {after:.3f} in {len(rows)} iterations ({wall:.0f} s)")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["cartpole", "arith"], required=True)
    p.add_argument("--losses", nargs="+", default=list(POLICY_LOSSES.names()))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="cartpole")
    p.add_argument("--seed", type=int, default=0, help="arith")
    p.add_argument("--iterations", type=int, default=60, help="arith: PPO iterations per loss")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = (cartpole if a.part == "cartpole" else arith)(a, Path(tmp))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
