"""The control actor-critic's cost: flat-parameter network vs the nn.Module one.

ppokit's first control network (commit ``ce1de33``, ``ppokit/control/networks.py``)
packed its layers into two flat parameter tensors, called ``F.linear`` by hand and
sampled categorical actions with the Gumbel-max trick. The current one is written like
CleanRL's ``ppo.py``: ``nn.Sequential`` trunks, ``nn.Linear`` heads with their init,
``torch.distributions`` for the update's log-probs and entropy (rollout actions are still
drawn with Gumbel-max). This script trains the ``cartpole`` preset with each network
through ppokit's run loop (``ppokit.workloads.train``, torch.optim's AdamW), in one
process, interleaved (A B B A ...), and prints the medians and the ratios to the old
network (> 1: slower).

- ``old``: the flat-parameter network, read from git into a temporary module;
- ``new``: the current network;
- ``new-categorical``: the current network drawing rollout actions with
  ``Categorical(logits).sample()`` instead of Gumbel-max.

Timed: ``train``, the sum of the iterations' ``time_collect`` and ``time_update``;
``cpu``, the process CPU time of the whole call (steadier on a shared machine: it does not
count the time this process waits for a core). Example::

    python bench/control_network.py --repeats 7
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OLD_REV = "ce1de33"  # the last commit with the flat-parameter network
NETWORK_PATH = "ppokit/control/networks.py"


def load_old_network(rev: str) -> type:
    """``ActorCritic`` of ``NETWORK_PATH`` at git revision ``rev``, imported from a temp file."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{NETWORK_PATH}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    with tempfile.TemporaryDirectory(prefix="ppokit-old-net-") as tmp:
        path = Path(tmp) / "flat_networks.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("flat_networks", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.ActorCritic


def categorical_sampling(net_cls: type) -> type:
    """``net_cls`` with rollout actions drawn by ``Categorical(logits).sample()``."""

    class Categorical(net_cls):
        def act(self, obs):
            dist, values = self._dist_and_value(obs)
            actions = dist.sample()
            return actions, self._log_prob(dist, actions), values

    return Categorical


def run(net_cls: type, steps: int, seed: int, out: str) -> dict[str, float]:
    """One ``cartpole`` run with ``net_cls`` as the actor-critic."""
    from ppokit.config import load_config
    from ppokit.control import workload
    from ppokit.persistence.rundir import create_run_dir, read_metrics
    from ppokit.workloads import train

    cfg = load_config(
        "cartpole",
        [
            f"seed={seed}",
            f"train.total_steps={steps}",
            "run.progress=false",
            "run.tensorboard=false",
            f"run.output_dir={out}",
        ],
    )
    real = workload.ActorCritic
    workload.ActorCritic = net_cls
    try:
        run_dir = create_run_dir(cfg)
        cpu = time.process_time()
        result = train(cfg, run_dir)
        cpu = time.process_time() - cpu
    finally:
        workload.ActorCritic = real
    rows = read_metrics(run_dir)
    collect = sum(r["time_collect"] for r in rows)
    update = sum(r["time_update"] for r in rows)
    return {
        "train": collect + update,
        "collect": collect,
        "update": update,
        "cpu": cpu,
        "return": result.get("eval_return_mean", float("nan")),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="rounds; each runs every network once")
    p.add_argument("--steps", type=int, default=100_000, help="env steps per run (the preset's 100k)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of the flat-parameter network")
    p.add_argument(
        "--nets",
        nargs="+",
        choices=["old", "new", "new-categorical"],
        default=["old", "new"],
        help="ratios are against the first",
    )
    a = p.parse_args()

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from ppokit.control.networks import ActorCritic

    available = {
        "old": lambda: load_old_network(a.old_rev),
        "new": lambda: ActorCritic,
        "new-categorical": lambda: categorical_sampling(ActorCritic),
    }
    nets = {name: available[name]() for name in a.nets}
    base = a.nets[0]
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, one thread, cartpole preset, "
        f"{a.steps} steps, seed {a.seed}; old = {a.old_rev}:{NETWORK_PATH}",
        flush=True,
    )
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in nets}
    with tempfile.TemporaryDirectory(prefix="ppokit-bench-") as out:
        for net in nets.values():  # warm-up: imports, first-call allocations
            run(net, 2048, a.seed, out)
        for r in range(a.repeats):
            order = list(nets) if r % 2 == 0 else list(nets)[::-1]  # ABBA: a drift in machine load cancels
            for name in order:
                gc.collect()
                res = run(nets[name], a.steps, a.seed, out)
                runs[name].append(res)
                print(
                    f"round {r} {name:16s} train {res['train']:.2f} s (collect {res['collect']:.2f}, update "
                    f"{res['update']:.2f}), cpu {res['cpu']:.2f} s, return {res['return']:.1f}",
                    flush=True,
                )
    print(f"\nmedians (s) and ratios X / {base} (> 1: X is slower); in brackets the median of the per-round ratios")
    for key in ("train", "collect", "update", "cpu"):
        ref = runs[base]
        m_ref = statistics.median(x[key] for x in ref)
        line = f"  {key:8s} {base} {m_ref:6.2f}"
        for name in a.nets[1:]:
            m = statistics.median(x[key] for x in runs[name])
            paired = statistics.median(n[key] / o[key] for o, n in zip(ref, runs[name]))
            line += f" | {name} {m:6.2f} ratio {m / m_ref:.3f} [{paired:.3f}]"
        print(line)


if __name__ == "__main__":
    main()
