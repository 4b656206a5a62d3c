"""Per-GPU memory of full-mode PPO on FSDP learners: measured at small scale, computed for 7B and 32B.

1. Measured: ``--world`` gloo ranks (CPU processes) each build the full-mode learner of a
   small Llama (``ppokit.lm.single_turn.workload.LMWorkload.learner_replica`` with
   :class:`ppokit.cluster.fsdp.FSDPParallel`: actor and critic sharded per decoder layer and
   root) and take one PPO update; each rank reads what it holds from its local shards
   (:func:`ppokit.cluster.fsdp.local_bytes`): parameters, gradients, Adam moments. One
   in-process learner (what every ddp rank holds) is measured the same way. Printed: the
   bytes per parameter each rank holds per ``1/W`` share of the model, and the ratio to
   the ddp learner.
2. Computed from those bytes per parameter: per-GPU memory of a learner rank for
   Llama-2-7B and Qwen2.5-32B shapes on 8 GPUs, with and without ``cluster.cpu_offload``:
   the sharded state, the units FSDP gathers for a pass (bf16 with run.precision=bf16:
   the root, i.e. both models' embeddings and LM heads, and two decoder layers, the one
   computed and the one prefetched, plus one layer's unsharded gradients), and the
   activations of a micro-batch of ``--tokens`` tokens through actor and critic (the
   formula of docs/scale.md, no recomputation). The training process's inference copy
   (scoring, evaluation, the rollout's weights) is listed apart.

    python bench/fsdp_memory.py                 # 2 ranks, a 4-layer model of hidden size 256
    python bench/fsdp_memory.py --world 2 --hidden 512 --layers 4 --tokens 4096
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GB = 1e9
# Llama-2-7B and Qwen2.5-32B: vocabulary, hidden, MLP, layers, KV width (grouped-query attention), q/k/v biases
SHAPES = {
    "7B (Llama-2-7B)": dict(V=32000, h=4096, f=11008, L=32, kv=4096, bias=False),
    "32B (Qwen2.5-32B)": dict(V=152064, h=5120, f=27648, L=64, kv=1024, bias=True),
}


def parameters(V: int, h: int, f: int, L: int, kv: int, bias: bool) -> dict[str, int]:
    """Parameter counts of a Llama-style model with an untied LM head: per layer, root (embeddings,
    LM head, final norm), total."""
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h + ((h + 2 * kv) if bias else 0)
    root = 2 * V * h + h
    return {"layer": layer, "root": root, "total": L * layer + root, "head": V * h}


def config(model_dir: Path, world: int):
    from ppokit.config import load_config

    return load_config(
        "arith",
        [
            f"model.path={model_dir}",
            "model.mode=full",
            "data.sft_epochs=0",
            "train.iterations=2",
            "train.batch_size=16",
            "train.mini_batch_size=8",
            "train.micro_batch_size=4",
            "run.precision=fp32",
            "run.torch_threads=1",
            f"cluster.learners={world}",
            "cluster.sharding=fsdp",
        ],
    )


def batch(vocab: int, n: int = 16, prompt: int = 4, response: int = 8):
    import torch

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(n, response)
    am = torch.ones(n, prompt + response, dtype=torch.long)
    return {
        "input_ids": torch.randint(4, vocab, (n, prompt + response), generator=g),
        "attention_mask": am,
        "position_ids": am.cumsum(1) - 1,
        "responses": torch.randint(4, vocab, (n, response), generator=g),
        "mask": mask,
        "old_log_prob": -torch.rand(n, response, generator=g),
        "old_values": torch.randn(n, response, generator=g),
        "advantages": torch.randn(n, response, generator=g),
        "returns": torch.randn(n, response, generator=g),
    }


def measure(learner, vocab: int) -> dict[str, int]:
    """One update (the Adam moments exist), then the bytes of parameters, the first mini-batch's
    gradients and the optimizer state, from this process's local tensors."""
    from ppokit.cluster.fsdp import local_bytes

    trainer = learner.trainer
    trainer.update(batch(vocab), 0)
    grads = trainer.mini_batch_gradients(batch(vocab))
    out = local_bytes(learner.policy, trainer.optimizer)
    out["grads"] = sum(
        (g.to_local() if hasattr(g, "to_local") else g).numel() * g.element_size() for g in grads.values()
    )
    out["numel"] = sum(p.numel() for p in learner.policy.parameters())  # whole (DTensor: global) sizes
    out["trained_numel"] = sum(p.numel() for p in learner.policy.parameters() if p.requires_grad)
    return out


def rank_main(rank: int, world: int, model_dir: str, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from ppokit.cluster.fsdp import FSDPParallel
    from ppokit.lm.single_turn.workload import LMWorkload

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    workload = LMWorkload(config(Path(model_dir), world))
    workload.model_path = Path(model_dir)
    learner = workload.learner_replica(FSDPParallel(rank, world))
    result = measure(learner, learner.policy.lm.config.vocab_size)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def measured(world: int, hidden: int, layers: int) -> dict:
    import torch.multiprocessing as mp

    from ppokit.cluster.parallel import free_port
    from ppokit.lm.model.tiny import build_tiny_model
    from ppokit.lm.single_turn.workload import LMWorkload
    from ppokit.trainer import SingleProcess

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", hidden_size=hidden, num_layers=layers, num_heads=4)
        mp.spawn(rank_main, args=(world, str(model_dir), free_port(), tmp), nprocs=world)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
        workload = LMWorkload(config(model_dir, 1))
        workload.model_path = model_dir
        learner = workload.learner_replica(SingleProcess())
        whole = measure(learner, learner.policy.lm.config.vocab_size)
    return {"world": world, "hidden": hidden, "layers": layers, "ranks": ranks, "ddp": whole}


def per_parameter(m: dict) -> dict[str, float]:
    """Bytes per parameter of a rank's 1/W share (the largest rank), by part."""
    w, ddp = m["world"], m["ddp"]
    worst = {k: max(r[k] for r in m["ranks"]) for k in ("params", "grads", "optimizer")}
    return {
        "params": worst["params"] / (ddp["numel"] / w),
        "grads": worst["grads"] / (ddp["trained_numel"] / w),
        "optimizer": worst["optimizer"] / (ddp["trained_numel"] / w),
    }


def computed(b: dict[str, float], gpus: int, tokens: int) -> list[dict]:
    """Per-GPU GB of a full-mode learner rank (actor and critic of the same shape, the critic's LM head
    frozen) from the measured bytes per parameter ``b``."""
    rows = []
    for name, s in SHAPES.items():
        n = parameters(**s)
        models_total = 2 * n["total"]
        trained = models_total - n["head"]  # the critic's LM head is frozen
        state = (b["params"] * models_total + (b["grads"] + b["optimizer"]) * trained) / gpus
        gathered = 2 * (2 * n["root"] + 2 * n["layer"]) + (2 + 4) * n["layer"]  # bf16 units, one layer's grads
        activations = 2 * 34 * tokens * s["h"] * s["L"] + 4 * tokens * s["V"]  # actor + critic; fp32 log-softmax
        rows.append(
            {
                "model": name,
                "parameters_per_model_B": n["total"] / 1e9,
                "sharded_state_GB": state / GB,
                "gathered_units_GB": gathered / GB,
                "activations_GB": activations / GB,
                "per_gpu_GB": (state + gathered + activations) / GB,
                "per_gpu_offload_GB": (gathered + activations) / GB,
                "cpu_per_rank_offload_GB": state / GB,
                "driver_copy_GB": (4 * models_total + 2 * n["total"]) / GB,  # fp32 actor + critic, bf16 reference
            }
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (activations)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    m = measured(a.world, a.hidden, a.layers)
    b = per_parameter(m)
    ddp = m["ddp"]
    print(
        f"measured: {a.world} gloo ranks, full mode, hidden {a.hidden}, {a.layers} layers, "
        f"{ddp['numel']:,} parameters (actor + critic)"
    )
    print(
        "| part | ddp learner (bytes) | "
        + " | ".join(f"fsdp rank {i}" for i in range(a.world))
        + " | ratio | B/param of a 1/W share |"
    )
    print("| --- | --- | " + " | ".join("---" for _ in range(a.world)) + " | --- | --- |")
    for part in ("params", "grads", "optimizer"):
        worst = max(r[part] for r in m["ranks"])
        print(
            f"| {part} | {ddp[part]:,} | "
            + " | ".join(f"{r[part]:,}" for r in m["ranks"])
            + f" | {worst / ddp[part]:.3f} | {b[part]:.2f} |"
        )
    rows = computed(b, a.gpus, a.tokens)
    print(f"\ncomputed: one learner rank of {a.gpus}, bf16 compute, {a.tokens} tokens per micro-batch (GB)")
    print(
        "| model | sharded state | gathered units | activations | per GPU | per GPU, CPU offload (CPU per rank) "
        "| training process's copy |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['sharded_state_GB']:.1f} | {r['gathered_units_GB']:.1f} | "
            f"{r['activations_GB']:.1f} | {r['per_gpu_GB']:.1f} | {r['per_gpu_offload_GB']:.1f} "
            f"({r['cpu_per_rank_offload_GB']:.1f}) | {r['driver_copy_GB']:.1f} |"
        )
    if a.out:
        a.out.write_text(json.dumps({"measured": m, "bytes_per_parameter": b, "computed": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
