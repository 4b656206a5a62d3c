"""The control actor-critic's cost: flat-parameter network vs the nn.Module one.

ppokit's first control network (commit ``ce1de33``, ``ppokit/control/networks.py``)
packed its layers into two flat parameter tensors, called ``F.linear`` by hand and
sampled categorical actions with the Gumbel-max trick. The current one is written like
CleanRL's ``ppo.py``: ``nn.Sequential`` trunks, ``nn.Linear`` heads, ``torch.distributions``.
This script trains CartPole with both, in one process, interleaved (A B B A A B ...),
and prints the medians and the ratio new / old (> 1: the new network is slower).

Two training loops, each with both networks:

- ``train_control``: ``ppokit.control.workload.train_control`` on the ``cartpole`` preset
  (what ``ppokit train cartpole`` runs, minus the CLI), with ppokit's foreach AdamW
  (``ppokit/optim.py``). Timed: ``train``, the sum of the per-iteration ``collect_time``
  and ``update_time`` from metrics.jsonl; ``wall``, the whole call (envs, final
  evaluation and checkpoint included); ``cpu``, the process CPU time of the whole call.
- ``torch_adamw``: the same rollout / GAE / ``PPOTrainer.update`` loop (epochs x
  shuffled mini-batches, ``clip_grad_norm_``, step), with ``torch.optim.AdamW(foreach=True)``
  in place of ppokit's AdamW. No tracker, evaluation or checkpoint. Timed: ``train``
  (wall, split into ``collect`` and ``update``) and ``cpu`` (process CPU time).

CPU time is the steadier figure on a shared machine: it does not count the time this
process waits for a core.

Every run uses the same seed, one torch thread and the preset's 100k env steps
(``--steps`` to change). The old network is read from git (``git show REV:path``) into a
temporary module; it is not part of the package. Examples::

    python bench/control_network.py                    # 5 rounds of 4 runs, about 4 minutes
    python bench/control_network.py --loops torch_adamw --nets new new-validated
    python bench/control_network.py --repeats 9 --profile
    python bench/control_network.py --breakdown         # where a rollout step's time goes
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import io
import json
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
OLD_REV = "ce1de33"  # the last commit with the flat-parameter network
NETWORK_PATH = "ppokit/control/networks.py"


def load_old_network(rev: str) -> type:
    """``ActorCritic`` of ``NETWORK_PATH`` at git revision ``rev``, imported from a temp file."""
    source = subprocess.run(["git", "show", f"{rev}:{NETWORK_PATH}"], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout
    with tempfile.TemporaryDirectory(prefix="ppokit-old-net-") as tmp:
        path = Path(tmp) / "flat_networks.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("flat_networks", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.ActorCritic


def make_config(steps: int, out: str, seed: int):
    from ppokit.config import load_config

    return load_config("cartpole", [f"seed={seed}", f"train.total_steps={steps}", "run.progress=false",
                                    "run.tensorboard=false", f"run.output_dir={out}"])


def run_train_control(net_cls: type, steps: int, seed: int) -> dict[str, float]:
    """``train_control`` with ``net_cls`` as the policy; seconds and the final deterministic return."""
    from ppokit.control import workload
    from ppokit.track import create_run_dir, read_metrics

    with tempfile.TemporaryDirectory(prefix="ppokit-bench-net-") as out:
        cfg = make_config(steps, out, seed)
        saved = workload.ActorCritic
        workload.ActorCritic = net_cls  # make_policy builds the policy from this name
        try:
            run_dir = create_run_dir(cfg)
            t0, c0 = time.perf_counter(), time.process_time()
            result = workload.train_control(cfg, run_dir)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        finally:
            workload.ActorCritic = saved
        rows = read_metrics(run_dir)
    collect = sum(r["collect_time"] for r in rows)
    update = sum(r["update_time"] for r in rows)
    return {"train": collect + update, "collect": collect, "update": update, "wall": wall, "cpu": cpu,
            "return": result.get("eval_return_mean", float("nan"))}


def torch_adamw_trainer(cfg, policy, iterations: int):
    """A ``PPOTrainer`` whose optimizer is ``torch.optim.AdamW(foreach=True)`` (schedule as ppokit's)."""
    from ppokit.optim import LRSchedule, lr_lambda
    from ppokit.trainer import PPOTrainer

    trainer = PPOTrainer(cfg, policy, total_iterations=iterations)
    groups = [dict(g, initial_lr=g["lr"]) for g in policy.param_groups(cfg) if g["params"]]
    trainer.optimizer = torch.optim.AdamW(groups, eps=cfg.train.adam_eps, weight_decay=cfg.train.weight_decay,
                                          foreach=True)
    updates = cfg.train.epochs * (cfg.train.batch_size // cfg.mini_batch_size)
    total = iterations * updates
    trainer.scheduler = LRSchedule(trainer.optimizer, lr_lambda(cfg.train.lr_scheduler_type,
                                                                int(cfg.train.lr_warmup_ratio * total), total))
    return trainer


def run_torch_adamw(net_cls: type, steps: int, seed: int, profile: cProfile.Profile | None = None) -> dict[str, float]:
    """Rollout + GAE + PPOTrainer.update with torch's AdamW; seconds (no eval, no checkpoint)."""
    from ppokit.control.envs import VecEnv
    from ppokit.control.rollout import Rollout
    from ppokit.control.workload import flatten_batch, setup
    from ppokit.trainer import compute_advantages

    with tempfile.TemporaryDirectory(prefix="ppokit-bench-net-") as out:
        cfg = make_config(steps, out, seed)
    setup(cfg)
    e = cfg.env
    venv = VecEnv(e, e.num_envs, seed=cfg.seed, gamma=cfg.algo.gamma, training=True)
    try:
        policy = net_cls(venv.obs_dim, venv.action_dim, venv.discrete, cfg.network)
        trainer = torch_adamw_trainer(cfg, policy, cfg.iterations)
        rollout = Rollout(venv, e.num_steps)
        collect = update = 0.0
        if profile is not None:
            profile.enable()
        c0 = time.process_time()
        for it in range(cfg.iterations):
            t0 = time.perf_counter()
            data = rollout.collect(policy)
            t1 = time.perf_counter()
            adv, ret = compute_advantages(cfg, rewards=data["rewards"], values=data["values"], mask=data["mask"],
                                          dones=data["dones"], last_values=data["last_values"])
            trainer.update(flatten_batch(data, adv, ret), it)
            t2 = time.perf_counter()
            collect += t1 - t0
            update += t2 - t1
        cpu = time.process_time() - c0
        if profile is not None:
            profile.disable()
        returns = venv.episode_returns
        return {"train": collect + update, "collect": collect, "update": update, "cpu": cpu,
                "return": float(sum(returns) / len(returns)) if returns else float("nan")}
    finally:
        venv.close()


LOOPS = {"train_control": run_train_control, "torch_adamw": run_torch_adamw}


def validated_network(net_cls: type) -> type:
    """``net_cls`` with torch.distributions' argument validation switched back on (its default)."""
    from ppokit.control import networks

    def forced(dist_cls):
        return lambda *args, validate_args=None, **kwargs: dist_cls(*args, validate_args=True, **kwargs)

    class Validated(net_cls):
        def _dist_and_value(self, obs):
            saved = networks.Categorical, networks.Normal
            networks.Categorical, networks.Normal = forced(saved[0]), forced(saved[1])
            try:
                return super()._dist_and_value(obs)
            finally:
                networks.Categorical, networks.Normal = saved

    return Validated


def rollout_variants(net_cls: type) -> dict[str, type]:
    """Discrete-action variants of the nn.Module network's ``act``, to split a rollout step's cost.

    - ``gumbel-max``: the same modules, actions sampled by hand (argmax of log-softmax plus
      Gumbel noise, the old network's sampler) instead of ``Categorical``;
    - ``multinomial``: the same modules, ``torch.multinomial`` on the softmax and the
      log-prob gathered from ``log_softmax``: no ``Distribution`` object, no trick;
    - ``functional``: ``Categorical`` kept, the layers applied with ``F.linear`` / ``tanh``
      on the same parameters instead of calling the modules.
    """
    import torch.nn.functional as F
    from torch.distributions import Categorical

    class GumbelMax(net_cls):
        def act(self, obs):
            logits = self.policy_head(self.actor(obs))  # (E, K)
            values = self.value_head(self.critic(obs)).squeeze(-1)
            log_p = torch.log_softmax(logits, dim=-1)
            actions = (log_p - torch.empty_like(log_p).exponential_().log_()).argmax(-1, keepdim=True)
            return actions.squeeze(-1), log_p.gather(-1, actions).squeeze(-1), values

    class Multinomial(net_cls):
        def act(self, obs):
            logits = self.policy_head(self.actor(obs))  # (E, K)
            values = self.value_head(self.critic(obs)).squeeze(-1)
            log_p = torch.log_softmax(logits, dim=-1)
            actions = torch.multinomial(log_p.exp(), 1)  # (E, 1)
            return actions.squeeze(-1), log_p.gather(-1, actions).squeeze(-1), values

    class Functional(net_cls):
        def act(self, obs):
            def mlp(seq, x):
                for layer in seq[::2]:
                    x = torch.tanh(F.linear(x, layer.weight, layer.bias))
                return x

            logits = F.linear(mlp(self.actor, obs), self.policy_head.weight, self.policy_head.bias)
            values = F.linear(mlp(self.critic, obs), self.value_head.weight, self.value_head.bias).squeeze(-1)
            dist = Categorical(logits=logits, validate_args=False)
            actions = dist.sample()
            return actions, dist.log_prob(actions), values

    return {"gumbel-max": GumbelMax, "multinomial": Multinomial, "functional": Functional}


def rollout_breakdown(nets: dict[str, type], rounds: int, seed: int) -> None:
    """CPU time per env step of ``Rollout.collect`` on the cartpole preset (8 envs x 32 steps), interleaved."""
    from ppokit.control.envs import VecEnv
    from ppokit.control.rollout import Rollout

    with tempfile.TemporaryDirectory(prefix="ppokit-bench-net-") as out:
        cfg = make_config(100_000, out, seed)
    e = cfg.env
    setups = {}
    for name, cls in nets.items():
        venv = VecEnv(e, e.num_envs, seed=seed, gamma=cfg.algo.gamma, training=True)
        torch.manual_seed(seed)
        setups[name] = (cls(venv.obs_dim, venv.action_dim, venv.discrete, cfg.network), Rollout(venv, e.num_steps))
    times: dict[str, list[float]] = {name: [] for name in setups}
    for policy, rollout in setups.values():
        for _ in range(10):
            rollout.collect(policy)
    per_round = 20
    for r in range(rounds):
        for name, (policy, rollout) in (list(setups.items()) if r % 2 == 0 else list(setups.items())[::-1]):
            c0 = time.process_time()
            for _ in range(per_round):
                rollout.collect(policy)
            times[name].append((time.process_time() - c0) / (per_round * e.num_steps) * 1e6)
    for policy, rollout in setups.values():
        rollout.venv.close()
    print(f"\nRollout.collect, CPU us per env step ({e.num_envs} envs; median of {rounds} rounds of {per_round} rollouts)")
    base = statistics.median(times[next(iter(times))])
    for name, t in times.items():
        m = statistics.median(t)
        print(f"  {name:12s} {m:7.1f}  (x{m / base:.2f})")


def profile_loop(net_cls: type, steps: int, seed: int) -> str:
    """cProfile of the torch_adamw loop with ``net_cls``: the top functions by own time."""
    prof = cProfile.Profile()
    run_torch_adamw(net_cls, steps, seed, profile=prof)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="rounds; each runs every (loop, network) once")
    p.add_argument("--steps", type=int, default=100_000, help="env steps per run (the preset's 100k)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--old-rev", default=OLD_REV, help="git revision of the flat-parameter network")
    p.add_argument("--loops", nargs="+", choices=sorted(LOOPS), default=["train_control", "torch_adamw"])
    p.add_argument("--nets", nargs="+", choices=["old", "new", "new-validated", "new-gumbel", "new-multinomial"], default=["old", "new"],
                   help="new-validated: the new network with torch.distributions' validate_args=True; new-gumbel: "
                        "the new network sampling rollout actions by hand (Gumbel-max, see rollout_variants); "
                        "new-multinomial: with torch.multinomial instead of Categorical in act; "
                        "ratios are against the first")
    p.add_argument("--profile", action="store_true", help="also cProfile one torch_adamw run of each network")
    p.add_argument("--breakdown", action="store_true",
                   help="only time Rollout.collect per env step: old, new, and new with Gumbel-max or "
                        "torch.multinomial sampling, or with F.linear layers")
    p.add_argument("--json", help="also write every run's timings to this file")
    a = p.parse_args()

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from ppokit.control.networks import ActorCritic as ModuleNet

    available = {"old": lambda: load_old_network(a.old_rev), "new": lambda: ModuleNet,
                 "new-validated": lambda: validated_network(ModuleNet),
                 "new-gumbel": lambda: rollout_variants(ModuleNet)["gumbel-max"],
                 "new-multinomial": lambda: rollout_variants(ModuleNet)["multinomial"]}
    nets = {name: available[name]() for name in a.nets}
    base = a.nets[0]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread, CartPole-v1 cartpole preset, {a.steps} steps, seed {a.seed}; "
          f"old = {a.old_rev}:{NETWORK_PATH}", flush=True)
    if a.breakdown:
        rollout_breakdown({"old": nets.get("old") or load_old_network(a.old_rev), "new": ModuleNet,
                           **rollout_variants(ModuleNet)}, max(a.repeats, 5) * 3, a.seed)
        return
    # warm-up: imports (torch.optim pulls in torch._dynamo), first-call allocations
    for loop in a.loops:
        for net in nets.values():
            LOOPS[loop](net, 2048, a.seed)

    cells = [(loop, name) for loop in a.loops for name in nets]
    runs: dict[tuple[str, str], list[dict[str, float]]] = {c: [] for c in cells}
    for r in range(a.repeats):
        order = cells if r % 2 == 0 else cells[::-1]  # ABBA: a drift in machine load cancels
        for loop, name in order:
            gc.collect()
            res = LOOPS[loop](nets[name], a.steps, a.seed)
            runs[(loop, name)].append(res)
            extra = (f" wall {res['wall']:.2f}" if "wall" in res else "") + f" cpu {res['cpu']:.2f}"
            print(f"round {r} {loop:13s} {name}: train {res['train']:.2f} s (collect {res['collect']:.2f}, "
                  f"update {res['update']:.2f}){extra}, return {res['return']:.1f}", flush=True)

    print(f"\nmedians (s) and ratios X / {base} (> 1: X is slower); in brackets the median of the per-round ratios")
    summary: dict[str, Any] = {}
    for loop in a.loops:
        ref = runs[(loop, base)]
        keys = ["train", "collect", "update"] + (["wall"] if "wall" in ref[0] else []) + ["cpu"]
        for key in keys:
            m_ref = statistics.median(x[key] for x in ref)
            line = f"  {loop:13s} {key:8s} {base} {m_ref:6.2f}"
            for name in a.nets[1:]:
                other = runs[(loop, name)]
                m = statistics.median(x[key] for x in other)
                paired = statistics.median(n[key] / o[key] for o, n in zip(ref, other))
                summary[f"{loop}/{key}/{name}"] = {base: m_ref, name: m, "ratio": m / m_ref, "paired_ratio": paired}
                line += f" | {name} {m:6.2f} ratio {m / m_ref:.3f} [{paired:.3f}]"
            print(line)
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "runs": {f"{k[0]}/{k[1]}": v for k, v in runs.items()}},
                                           indent=1))
    if a.profile:
        for name, net in nets.items():
            print(f"\n--- cProfile, torch_adamw loop, {name} network ---")
            print(profile_loop(net, a.steps, a.seed))


if __name__ == "__main__":
    main()
