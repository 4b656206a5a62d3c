"""Scale-out on Ray, measured on this machine (CPU actors, gloo): equality, gradients,
pipelining, weight sync. Every run is a ``ppokit train`` subprocess that starts its own
local Ray (``cluster.address`` null), as a user's does; the results go to stdout and,
as JSON, to ``--out``.

``equality``  1 rollout worker + 1 learner against the in-process run, same seed:
              every non-timing field of ``metrics.jsonl`` equal, bit for bit (the worker
              rows add ``sync_bytes``). CartPole: the whole preset. arith: the first
              ``--arith-rows`` iterations of the preset at full size (each run is stopped
              with SIGTERM once it has logged them: a 400-iteration schedule, as the preset's).
``gradients`` 2 learners (gloo) against 1 on the same mini-batch of the arith preset's
              model: max abs difference of the first optimizer step's gradient, for
              each ``loss_agg_mode``.
``pipeline``  the arith preset (after one shared warm start) four ways, one after the
              other in one invocation: synchronous in-process with 1 and with 2 torch
              threads, and ``rollout.off_policy_steps`` = 1 and = 2 with 1 rollout worker +
              the learner in the training process, one torch thread each. Iterations per
              second (training phases, the held-out evaluations left out), held-out accuracy
              at the end and at each periodic evaluation (equal samples: every run has
              the same batch), and where each iteration's time goes.
``sync``      bytes and seconds of one weight sync to a rollout worker for bench/lm.py's
              ~50 M-parameter model: the LoRA actor adapter (model.mode=lora) against the
              whole actor (model.mode=full); median of ``--repeats`` syncs.

Examples::

    python bench/dist.py equality
    python bench/dist.py pipeline --iterations 400
    python bench/dist.py sync gradients
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TIMING_PREFIX = "time_"
TIMING = {"time", "wall_time", "sps", "gen_tokens_per_s", "score_tokens_per_s", "train_tokens_per_s", "sync_time"}


def env() -> dict[str, str]:
    out = dict(os.environ)
    out.setdefault("RAY_AUTH_MODE", "disabled")
    return out


def rows(run_dir: Path) -> list[dict]:
    from ppokit.persistence.rundir import read_metrics

    return read_metrics(run_dir)


def train(args: list[str], out: Path, name: str, stop_after: int | None = None) -> tuple[list[dict], float]:
    """``ppokit train ARGS`` in a subprocess; with ``stop_after``, SIGTERM once that many rows are logged."""
    cmd = [
        sys.executable,
        "-m",
        "ppokit",
        "train",
        *args,
        "run.progress=false",
        "run.tensorboard=false",
        "--output-dir",
        str(out),
        "--name",
        name,
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    if stop_after is not None:
        while proc.poll() is None and len(rows(out / name)) < stop_after:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate()
    if proc.returncode not in (0, 143):
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    return rows(out / name), time.perf_counter() - start


def compare(local: list[dict], remote: list[dict], n: int) -> dict:
    """Fields that differ in the first ``n`` rows (timing fields and sync_bytes aside)."""
    diffs = []
    for a, b in zip(local[:n], remote[:n]):
        for key in sorted(set(a) | set(b)):
            if key in TIMING or key.startswith(TIMING_PREFIX) or key == "sync_bytes":
                continue
            if a.get(key) != b.get(key):
                diffs.append((a["iteration"], key, a.get(key), b.get(key)))
    return {
        "rows": min(n, len(local), len(remote)),
        "differences": len(diffs),
        "first": diffs[:5],
        "fields": len([k for k in local[0] if k not in TIMING and not k.startswith(TIMING_PREFIX)]),
    }


# ----------------------------------------------------------------------------- equality
def bench_equality(a: argparse.Namespace, out: Path) -> dict:
    result = {}
    local, _ = train(["cartpole", f"seed={a.seed}"], out, "cartpole-local")
    remote, _ = train(["cartpole", f"seed={a.seed}", "cluster.rollout_workers=1"], out, "cartpole-worker")
    result["cartpole"] = compare(local, remote, len(local))
    result["cartpole"]["iterations"] = len(local)
    arith = ["arith", f"seed={a.seed}"]
    local, _ = train(arith, out, "arith-local", stop_after=a.arith_rows)
    remote, _ = train(arith + ["cluster.rollout_workers=1"], out, "arith-worker", stop_after=a.arith_rows)
    result["arith"] = compare(local, remote, a.arith_rows)
    for name, r in result.items():
        print(
            f"equality {name}: {r['rows']} rows, {r['fields']} non-timing fields each, "
            f"{r['differences']} differences {r['first'] or ''}"
        )
    return result


# ----------------------------------------------------------------------------- gradients
def bench_gradients(a: argparse.Namespace, out: Path) -> dict:
    import ray

    from ppokit.cluster.learner_group import LearnerGroup
    from ppokit.cluster.ray_cluster import Cluster, start_local_ray
    from ppokit.config import load_config
    from ppokit.lm.model.tiny import build_tiny_model
    from ppokit.lm.single_turn.workload import LMWorkload
    from ppokit.trainer import SingleProcess

    sys.path.insert(0, str(ROOT / "tests" / "cluster"))
    from test_cluster_learners import random_lm_batch

    model = build_tiny_model(out / "tiny", seed=0)  # the arith preset's built-in model
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    result = {}
    group = cluster = None
    try:
        for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            cfg = load_config(
                "arith",
                [
                    f"model.path={model}",
                    "data.sft_epochs=0",
                    f"algo.loss_agg_mode={mode}",
                    "cluster.learners=2",
                    "run.precision=fp32",
                    "run.torch_threads=1",
                ],
            )
            w = LMWorkload(cfg)
            w.model_path = model
            local = w.learner_replica(SingleProcess())
            if group is None:
                cluster = Cluster(cfg, rollout_workers=0, learners=2)
                group = LearnerGroup.start(cluster, w, local, 2)
            else:
                group.local = local
                ray.get([r.rebuild.remote(w) for r in group.ranks])
                group.sync_ranks()
            from transformers import AutoConfig

            batch = random_lm_batch(cfg.train.batch_size, 6, 4, AutoConfig.from_pretrained(model).vocab_size)
            together = group.gradients(batch)
            alone = local.trainer.mini_batch_gradients(batch)
            worst = max((together[k] - alone[k]).abs().max().item() for k in alone)
            scale = max(v.abs().max().item() for v in alone.values())
            result[mode] = {"max_abs_diff": worst, "max_abs_grad": scale}
            print(
                f"gradients {mode}: mini-batch {cfg.mini_batch_size} split over 2 gloo ranks: max abs difference "
                f"{worst:.3g} (largest gradient entry {scale:.3g})"
            )
    finally:
        if cluster is not None:
            cluster.close()
        ray.shutdown()
    return result


# ----------------------------------------------------------------------------- pipeline
def phase_means(r: list[dict]) -> dict:
    keys = [
        "time_collect",
        "time_score",
        "time_update",
        "time_generate",
        "time_behaviour_log_prob",
        "time_reward",
        "time_rollout_wait",
        "time_load_weights",
        "sync_time",
        "time_iteration",
    ]
    return {k: statistics.fmean(x[k] for x in r if k in x) for k in keys if any(k in x for x in r)}


def bench_pipeline(a: argparse.Namespace, out: Path) -> dict:
    # one warm start for all three runs: the preset's, stopped after one iteration
    train(["arith", f"seed={a.seed}", "train.iterations=1"], out, "warm")
    base = out / "warm" / "base_model"
    common = ["arith", f"seed={a.seed}", f"model.path={base}", "data.sft_epochs=0", f"train.iterations={a.iterations}"]
    runs = {
        "sync_1thread": common + ["run.torch_threads=1"],
        "sync_2threads": common + ["run.torch_threads=2"],
        "pipelined_1worker": common
        + [
            "run.torch_threads=1",
            "rollout.off_policy_steps=1",
            "cluster.rollout_workers=1",
            "cluster.cpus_per_worker=1",
        ],
        "pipelined2_1worker": common
        + [
            "run.torch_threads=1",
            "rollout.off_policy_steps=2",
            "cluster.rollout_workers=1",
            "cluster.cpus_per_worker=1",
        ],
    }
    result = {}
    for name, args in runs.items():
        if a.runs and name not in a.runs:
            continue
        r, wall = train(args, out, name)
        # the training phases of each iteration (collect + score + update, sync included); the
        # held-out evaluations (the same in every run) and logging left out
        loop_s = sum(x["time_collect"] + x.get("time_score", 0.0) + x["time_update"] for x in r)
        result[name] = {
            "iterations": len(r),
            "it_per_s": len(r) / loop_s,
            "loop_seconds": loop_s,
            "it_per_s_with_evaluations": len(r) / r[-1]["wall_time"],
            "process_seconds": wall,
            "accuracy_after": r[-1].get("eval_accuracy_after"),
            "accuracy_by_iteration": {x["iteration"] + 1: x["eval_accuracy"] for x in r if "eval_accuracy" in x},
            "phases": phase_means(r),
        }
        print(
            f"pipeline {name}: {len(r)} iterations, {result[name]['it_per_s']:.3f} it/s (training phases), "
            f"held-out accuracy {result[name]['accuracy_after']} "
            f"(periodic: {json.dumps(result[name]['accuracy_by_iteration'])}), "
            f"phases {json.dumps(result[name]['phases'])}"
        )
    for piped in ("pipelined_1worker", "pipelined2_1worker"):
        p = result.get(piped)
        for base_name in ("sync_1thread", "sync_2threads"):
            s = result.get(base_name)
            if p is None or s is None:
                continue
            print(
                f"pipeline {piped} speed-up over {base_name}: {p['it_per_s'] / s['it_per_s']:.2f}x; accuracy "
                f"{p['accuracy_after']:.3f} vs {s['accuracy_after']:.3f}"
            )
    return result


# ----------------------------------------------------------------------------- sync
def bench_sync(a: argparse.Namespace, out: Path) -> dict:
    import ray

    from ppokit.cluster.ray_cluster import Cluster, start_local_ray
    from ppokit.cluster.rollout_workers import RolloutWorker
    from ppokit.cluster.weights import MIB, buckets
    from ppokit.config import load_config
    from ppokit.lm.model.tiny import build_tiny_model
    from ppokit.lm.single_turn.workload import LMWorkload
    from ppokit.trainer import SingleProcess

    path = Path(tempfile.gettempdir()) / "ppokit-bench-lm-h640-l10-m0"  # bench/lm.py's default model
    model = build_tiny_model(
        path, hidden_size=640, num_layers=10, num_heads=10, intermediate_size=None, max_position_embeddings=256, seed=0
    )
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_local_ray(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    result = {}
    try:
        for mode in ("lora", "full"):
            cfg = load_config(
                "arith",
                [
                    f"model.path={model}",
                    f"model.mode={mode}",
                    "data.sft_epochs=0",
                    "cluster.rollout_workers=1",
                    "run.precision=fp32",
                    "run.torch_threads=1",
                ],
            )
            w = LMWorkload(cfg)
            w.model_path = model
            learner = w.learner_replica(SingleProcess())
            params = sum(p.numel() for p in learner.policy.parameters())
            cluster = Cluster(cfg, rollout_workers=1, learners=0)
            try:
                worker = cluster.start_actor(RolloutWorker, "rollout", 0, w, 0, 1)
                times, loads = [], []
                for v in range(a.repeats + 1):  # as RemoteSource.sync_weights: buckets of cluster.sync_bucket_mb
                    start = time.perf_counter()
                    weights = learner.rollout_weights()
                    refs = [ray.put(b) for b in buckets(weights.items(), cfg.cluster.sync_bucket_mb * MIB)]
                    loads.append(ray.get(worker.set_weights.remote(refs, v)))
                    times.append(time.perf_counter() - start)
                nbytes = sum(t.numel() * t.element_size() for t in weights.values())
            finally:
                cluster.close()
            result[mode] = {
                "bytes": nbytes,
                "tensors": len(weights),
                "model_parameters": params,
                "sync_seconds": statistics.median(times[1:]),
                "worker_load_seconds": statistics.median(loads[1:]),
            }
            print(
                f"sync {mode}: {nbytes / 2**20:.2f} MiB in {len(weights)} tensors, "
                f"{result[mode]['sync_seconds'] * 1e3:.1f} ms a sync (worker load "
                f"{result[mode]['worker_load_seconds'] * 1e3:.1f} ms); model {params / 1e6:.1f} M parameters"
            )
            del learner
    finally:
        ray.shutdown()
    if "lora" in result and "full" in result:
        print(
            f"sync lora/full: {result['lora']['bytes'] / result['full']['bytes']:.4f} of the bytes, "
            f"{result['lora']['sync_seconds'] / result['full']['sync_seconds']:.3f} of the time"
        )
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "what",
        nargs="*",
        default=["equality", "gradients", "sync", "pipeline"],
        choices=["equality", "gradients", "sync", "pipeline"],
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--arith-rows", type=int, default=20, help="arith iterations compared in 'equality'")
    p.add_argument("--iterations", type=int, default=400, help="arith iterations of 'pipeline' (the preset: 400)")
    p.add_argument("--runs", nargs="*", default=None, help="'pipeline': only these of its runs (default: all four)")
    p.add_argument("--repeats", type=int, default=5, help="syncs timed in 'sync'")
    p.add_argument("--out", type=Path, default=None, help="directory for the runs and results.json")
    a = p.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="ppokit-bench-dist-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"runs and results in {out}")
    results = {}
    for what in a.what:
        results[what] = globals()[f"bench_{what}"](a, out)
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
