"""FSDP with one learner on CUDA (nccl): the sharded learner's GPU path, in one process, in a minute.

A one-rank process group (nccl on a GPU; ``--smoke``: gloo on the CPU) builds the full-mode
learner of a randomly initialised Llama (``LMWorkload.learner_replica`` with
:class:`ppokit.cluster.fsdp.FSDPParallel`, as a ``cluster.sharding=fsdp`` learner rank does),
without and with ``cluster.cpu_offload``, and for each:

- takes ``--updates`` PPO updates on a random batch (bf16 compute on a GPU, float32 with
  ``--smoke``): seconds per update, finite gradient norms;
- reads what the rank holds (parameters, gradients, Adam moments: :func:`ppokit.cluster.fsdp.local_bytes`)
  and, on a GPU, the allocator's peak;
- gathers every trained weight whole (``full_tensor``, the path weights take to the training
  process) and checks it against the rank's own shards;
- writes the Adam moments with torch.distributed.checkpoint's safetensors storage
  (:func:`ppokit.persistence.checkpoint.save_shards`), reads them back into zeroed tensors and checks them.

Then, against the unsharded learner (``cluster.sharding=ddp``, one rank) from the same weights
on the same batch:

- the metrics of every update (losses, gradient norms, KL) and the trained weights after them
  agree with FSDP's to bf16 tolerance (``ddp_max_rel_metric``, ``ddp_weight_rel``);
- resume: the FSDP learner's state after ``--updates - 1`` updates (the Adam moments as DCP
  shards, :class:`ppokit.cluster.learner_group.LearnerRank`'s ``state_dict`` and ``save_shards``)
  is loaded into a fresh FSDP learner, which takes the last update as the original did
  (``resume_max_rel_metric``, ``resume_weight_rel``).

Prints one JSON line (``FSDP_CHECK_RESULT {...}``), the form ``bench/gpu_check.py``'s steps
return.

    python bench/fsdp_check.py            # one CUDA GPU
    python bench/fsdp_check.py --smoke    # the same on the CPU with gloo, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT_TAG = "FSDP_CHECK_RESULT "
# (hidden, layers, heads, sequences, prompt tokens, response tokens): ~0.1 B parameters for actor
# and critic on a GPU; tiny for --smoke
SHAPES = {"gpu": (768, 8, 12, 32, 16, 32), "smoke": (64, 2, 2, 8, 4, 8)}


def learner_config(model_dir: Path, *, device: str, offload: bool, sequences: int, bf16: bool):
    from ppokit.config import load_config

    return load_config(
        "arith",
        [
            f"model.path={model_dir}",
            "model.mode=full",
            "data.sft_epochs=0",
            "train.iterations=4",
            f"train.batch_size={sequences}",
            f"train.mini_batch_size={sequences // 2}",
            f"train.micro_batch_size={sequences // 4}",
            f"run.device={device}",
            f"run.precision={'bf16' if bf16 else 'fp32'}",
            "cluster.sharding=fsdp",
            f"cluster.cpu_offload={str(offload).lower()}",
        ],
    )


def random_batch(vocab: int, device: str, n: int, prompt: int, response: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    am = torch.ones(n, prompt + response, dtype=torch.long)
    tensors = {
        "input_ids": torch.randint(4, vocab, (n, prompt + response), generator=g),
        "attention_mask": am,
        "position_ids": am.cumsum(1) - 1,
        "responses": torch.randint(4, vocab, (n, response), generator=g),
        "mask": torch.ones(n, response),
        "old_log_prob": -torch.rand(n, response, generator=g) * 4,
        "old_values": torch.randn(n, response, generator=g),
        "advantages": torch.randn(n, response, generator=g),
        "returns": torch.randn(n, response, generator=g),
    }
    return {k: v.to(device) for k, v in tensors.items()}


def one_learner(model_dir: Path, device: str, offload: bool, updates: int, shape: tuple, bf16: bool) -> dict:
    """The checks of the module docstring for one learner (with or without CPU offload)."""
    import torch
    from torch.distributed.tensor import DTensor

    from ppokit.cluster.fsdp import FSDPParallel, full_tensor, local_bytes
    from ppokit.lm.single_turn.workload import LMWorkload
    from ppokit.persistence.checkpoint import load_shards, save_shards

    n, prompt, response = shape[3:]
    workload = LMWorkload(learner_config(model_dir, device=device, offload=offload, sequences=n, bf16=bf16))
    workload.model_path = model_dir
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    learner = workload.learner_replica(FSDPParallel(0, 1, device_type=device, offload=offload))
    trainer = learner.trainer
    batch = random_batch(learner.policy.lm.config.vocab_size, device, n, prompt, response)
    seconds, norms = [], []
    for it in range(updates):
        start = time.perf_counter()
        metrics = trainer.update(dict(batch), it)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        norms += [metrics["grad_norm/actor"], metrics["grad_norm/critic"]]
    held = local_bytes(learner.policy, trainer.optimizer)
    weights = learner.trained_weights()
    whole = {name: full_tensor(t) for name, t in weights.items()}  # one rank: the shard is the whole
    gathered_ok = all(
        torch.equal(whole[n], (t.to_local() if isinstance(t, DTensor) else t).detach().cpu())
        for n, t in weights.items()
    )
    moments = {
        f"{i}.{slot}": trainer.optimizer.state[p][slot]
        for i, p in enumerate(trainer.params)
        for slot in ("exp_avg", "exp_avg_sq")
        if slot in trainer.optimizer.state[p]
    }
    with tempfile.TemporaryDirectory() as tmp:
        save_shards(Path(tmp) / "shards", moments)
        back = {k: torch.zeros_like(v) for k, v in moments.items()}
        load_shards(Path(tmp) / "shards", back)
    shards_ok = all(torch.equal(back[k].to_local(), v.to_local()) for k, v in moments.items())
    out = {
        "offload": offload,
        "update_s": sorted(seconds)[len(seconds) // 2],
        "first_update_s": seconds[0],
        "grad_norms_finite": all(math.isfinite(x) for x in norms),
        "param_bytes": held["params"],
        "optimizer_bytes": held["optimizer"],
        "gathered_equal": gathered_ok,
        "shards_roundtrip": shards_ok,
        "param_device": str(next(iter(weights.values())).to_local().device),
    }
    if device == "cuda":
        out["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out


def check(smoke: bool, updates: int = 3, bf16: bool | None = None) -> dict:
    """Both learners in a one-rank group (nccl on the GPU, gloo with ``smoke``); ``bf16``: the
    precision (default: bf16 on the GPU, float32 with ``smoke``)."""
    import torch
    import torch.distributed as dist

    from ppokit.cluster.parallel import free_port
    from ppokit.lm.model.tiny import build_tiny_model

    device = "cpu" if smoke else "cuda"
    bf16 = device == "cuda" if bf16 is None else bf16
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fsdp_check: no CUDA device here; run it on a GPU, or with --smoke on the CPU")
    shape = SHAPES["smoke" if smoke else "gpu"]
    hidden, layers, heads = shape[:3]
    dist.init_process_group(
        "gloo" if smoke else "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_tiny_model(
                Path(tmp) / "model", hidden_size=hidden, num_layers=layers, num_heads=heads, max_position_embeddings=64
            )
            rows = [one_learner(model_dir, device, offload, updates, shape, bf16) for offload in (False, True)]
            against = against_ddp(model_dir, device, updates, shape, bf16)
    finally:
        dist.destroy_process_group()
    ok = all(r["grad_norms_finite"] and r["gathered_equal"] and r["shards_roundtrip"] for r in rows)
    ok = ok and against["ok"]
    return {
        "step": "fsdp one learner",
        "device": device,
        "backend": "gloo" if smoke else "nccl",
        "ok": ok,
        "learners": rows,
        "against_ddp": against,
    }


# Tolerances against the unsharded learner. FSDP's MixedPrecisionPolicy computes with bf16
# parameters, the unsharded learner under bf16 autocast with float32 ones (norms, softmax and
# the gradients' sums in float32): the same update to about 1e-3 in bf16, not bit for bit
# (measured on the CPU with gloo, `--smoke --bf16`: continuous metrics of the first update
# within 4e-4). Float32 on both sides (`--smoke`) is exact to 1e-4.
#   rtol       the relative difference of a continuous metric (losses, gradient norms, KL)
#   frac_atol  the absolute difference of a fraction of tokens (clipfrac, vf_clipfrac): one
#              token's ratio on the other side of a clip moves it by 1/tokens
#   cos        the cosine of the first update's weight change: Adam's first step is about
#              lr * sign(g), so a weight whose gradient is near 0 may move either way, and the
#              relative norm of the difference says little; the direction must agree
TOLERANCES = {
    "bf16": {"rtol": 5e-2, "frac_atol": 0.1, "cos": 0.9},
    "fp32": {"rtol": 1e-4, "frac_atol": 1e-4, "cos": 1 - 1e-6},
}
# metrics that measure time or memory, not the update
NOT_COMPARED = ("time", "memory", "tokens_per_s", "lr")


def compared(metrics: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and math.isfinite(v) and not any(w in k for w in NOT_COMPARED)
    }


def is_fraction(key: str) -> bool:
    return key.endswith("frac") or "frac_" in key


def max_rel(a: list[dict], b: list[dict], fractions: bool = False) -> tuple[float, str]:
    """The largest |a - b| / max(|a|, |b|, 1e-3) over the continuous metrics of each update
    (``fractions``: the largest |a - b| over the fractions of tokens), and its key."""
    worst, where = 0.0, ""
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = compared(x), compared(y)
        for k in x.keys() & y.keys():
            if is_fraction(k) != fractions:
                continue
            diff = abs(x[k] - y[k])
            rel = diff if fractions else diff / max(abs(x[k]), abs(y[k]), 1e-3)
            if rel > worst:
                worst, where = rel, f"update {i + 1}: {k}"
    return worst, where


def change_cosine(start: dict, a: dict, b: dict) -> float:
    """The cosine of the weights' changes ``a - start`` and ``b - start`` (float64)."""
    dot = sum(float(((a[n].double() - start[n].double()) * (b[n].double() - start[n].double())).sum()) for n in start)
    na = sum(float(((a[n].double() - start[n].double()) ** 2).sum()) for n in start)
    nb = sum(float(((b[n].double() - start[n].double()) ** 2).sum()) for n in start)
    return dot / max(math.sqrt(na * nb), 1e-30)


def weight_change_rel(start: dict, a: dict, b: dict) -> float:
    """||(a - start) - (b - start)|| / ||a - start|| over all trained weights (float64)."""
    num = sum(float(((a[n].double() - b[n].double()) ** 2).sum()) for n in start)
    den = sum(float(((a[n].double() - start[n].double()) ** 2).sum()) for n in start)
    return math.sqrt(num / max(den, 1e-30))


def against_ddp(model_dir: Path, device: str, updates: int, shape: tuple, bf16: bool) -> dict:
    """The unsharded learner and FSDP's from the same weights on the same batch; then FSDP's
    checkpoint after ``updates - 1`` updates resumed in a fresh FSDP learner (module docstring)."""
    import torch

    from ppokit.cluster.fsdp import full_tensor
    from ppokit.cluster.learner_group import LearnerRank
    from ppokit.cluster.parallel import ProcessGroupParallel
    from ppokit.components import Batch
    from ppokit.lm.single_turn.workload import LMWorkload

    n, prompt, response = shape[3:]

    def rank(sharding: str) -> LearnerRank:
        cfg = learner_config(model_dir, device=device, offload=False, sequences=n, bf16=bf16)
        cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"sharding": sharding})})
        workload = LearnerRank(LMWorkload(cfg), 0, 1)
        workload.workload.model_path = model_dir
        workload.group = ProcessGroupParallel(0, 1)
        workload.rebuild(workload.workload)
        return workload

    def whole(r: LearnerRank) -> dict:
        return {k: full_tensor(t).float().cpu().clone() for k, t in r.learner.trained_weights().items()}

    def run(r: LearnerRank, first: int, last: int, batch: dict) -> list[dict]:
        return [r.update(Batch(tensors=dict(batch)), it) for it in range(first, last)]

    ddp = rank("ddp")
    start = whole(ddp)
    batch = random_batch(ddp.learner.policy.lm.config.vocab_size, device, n, prompt, response)
    ddp_metrics = run(ddp, 0, 1, batch)
    ddp_first = whole(ddp)  # after the first update: its direction is compared
    ddp_metrics += run(ddp, 1, updates, batch)
    fsdp = rank("fsdp")
    fsdp.load_weights(start)
    fsdp_metrics, fsdp_first = [], None
    for it in range(updates - 1):
        fsdp_metrics += run(fsdp, it, it + 1, batch)
        fsdp_first = whole(fsdp) if it == 0 else fsdp_first
    with tempfile.TemporaryDirectory() as tmp:  # a checkpoint: the state written, then read back
        torch.save(fsdp.state_dict(), Path(tmp) / "state.pt")
        fsdp.save_shards(tmp)
        saved = whole(fsdp)
        fsdp_metrics += run(fsdp, updates - 1, updates, batch)
        fsdp_first = whole(fsdp) if fsdp_first is None else fsdp_first  # one update: the last is the first
        resumed = rank("fsdp")
        resumed.load_weights(saved)
        resumed.load_state(torch.load(Path(tmp) / "state.pt", weights_only=False), tmp)
    resumed_metrics = run(resumed, updates - 1, updates, batch)
    ddp_rel, ddp_where = max_rel(ddp_metrics, fsdp_metrics)
    frac_diff, frac_where = max_rel(ddp_metrics, fsdp_metrics, fractions=True)
    first_cos = change_cosine(start, ddp_first, fsdp_first)
    resume_rel, resume_where = max_rel(fsdp_metrics[-1:], resumed_metrics)
    weights_rel = weight_change_rel(start, whole(ddp), whole(fsdp))
    resume_weights = weight_change_rel(saved, whole(fsdp), whole(resumed))
    tol = TOLERANCES["bf16" if bf16 else "fp32"]
    del ddp, fsdp, resumed
    if device == "cuda":
        torch.cuda.empty_cache()
    exact = 1e-4  # resuming FSDP's own checkpoint: the same numerics on both sides
    return {
        "ok": ddp_rel <= tol["rtol"]
        and frac_diff <= tol["frac_atol"]
        and first_cos >= tol["cos"]
        and resume_rel <= exact
        and resume_weights <= exact,
        "tolerance": tol,
        "ddp_max_rel_metric": ddp_rel,
        "ddp_worst": ddp_where,
        "ddp_max_frac_diff": frac_diff,
        "ddp_frac_worst": frac_where,
        "ddp_first_update_cosine": first_cos,
        "ddp_weight_rel": weights_rel,
        "resume_max_rel_metric": resume_rel,
        "resume_worst": resume_where,
        "resume_weight_rel": resume_weights,
        "first_update": {k: compared(fsdp_metrics[0]).get(k) for k in ("policy_loss", "value_loss", "grad_norm/actor")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the CPU with gloo and tiny shapes (the plumbing)")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument(
        "--bf16", action="store_true", help="with --smoke: bf16 as on the GPU (within bf16 tolerance, not exact)"
    )
    args = parser.parse_args(argv)
    result = check(args.smoke, args.updates, bf16=True if args.bf16 else None)
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
