"""Language-model PPO: memory, achieved FLOP/s, iteration time and KV-cache speed-up.

One PPO iteration (generate -> score -> update) on a randomly initialised Llama-style
model built locally (``ppokit.lm.model.tiny``, character vocabulary; about 50 M parameters by
default; 256 sequences, the issue's 32 prompts x 8 samples, generated in one call).
Each measurement runs in its own Python process, so peak memory is that of one
configuration only. The whole default run takes about 14 minutes on one core here.
Reported, each against its goal:

``memory``    peak memory of one iteration, shared-LoRA (actor + critic adapters and
              the reference on one backbone) over separate models (full fine-tuning:
              actor, critic, frozen reference copy). Both with a KL term in the loss
              (beta > 0), so both need a reference. CPU: peak RSS minus the RSS after
              imports; CUDA: ``torch.cuda.max_memory_allocated``. Goal <= 0.4.
``update``    achieved FLOP/s of the update phase over a measured matmul ceiling
              (a 2048^3 matmul in the precision in use, same threads/device). Model
              FLOPs are counted from the shapes actually computed (padding included):
              linear layers 2 * params * tokens, attention 4 * L^2 * hidden per layer,
              lm_head only at response positions; a LoRA pass backward costs one more
              forward (input gradients only, the backbone is frozen). Goal >= 40 %.
              Two ceilings are printed. The peak is the best single matmul (tens of
              milliseconds). The sustained ceiling is matmuls run back to back right
              after each phase, for as long as that phase took; phases and ceiling are
              then both averages over the same stretches of the host's load (phase
              times are means over ``--repeats`` iterations). On a shared host the
              peak is faster than any seconds-long window: 0.95-1.0 against 0.45-0.73
              TFLOP/s for 5-second windows of the same matmul here. The goal is judged
              on the sustained ceiling; the ratio to the peak is printed beside it.
              The ``bound`` line runs the update's layer matmuls alone (same
              shapes, forward and input gradient, nothing else) alternately with the
              peak matmul: about the most an update of these layers can reach.
``iteration`` wall time of the whole iteration over its compute floor (all FLOPs of
              generation, scoring and update at the sustained ceiling; at the peak
              beside it). Goal <= 2.
``kv-cache``  generation tokens/s with the KV cache over without it, and with the
              static cache (``rollout.cache_implementation=static``; compiled on CUDA)
              over the dynamic one.
``lora``      (``--only lora``) score and update times with ppokit's fused LoRA layers
              and with peft's own forward, alternating in one process.
``kernels``   (``--only kernels``) the same with ppokit's fused CPU kernels (RMSNorm,
              SwiGLU, rotary, attention; ``ppokit/lm/accel/kernels``) and with transformers' layers.
``layout``    (``--only layout``) the same with the wide frozen bf16 weights stored
              column-major (``ppokit/lm/accel/weight_layout.py``) and row-major.
``attention`` (``--only attention``) the same with the attention kernel of training and
              scoring passes and with eager attention (the other kernels on in both).
``profile``   (``--only profile``) one iteration under torch.profiler: each phase's
              operators by self time (``--rows`` of them), to see where the time goes.
``amx``       (``--only amx``) the same with LoRA's rank-r products on ppokit's kernels (AMX,
              or AVX512-BF16 vectors on CPUs without it) and on oneDNN's matmuls (bf16).

Responses are forced to full length (``min_new_tokens``), so every run does the same work.

Examples::

    python bench/lm.py                       # ~50 M parameters, 256 sequences, bf16 where supported
    python bench/lm.py --batch 64 --perf-micro 16   # the earlier, smaller iteration
    python bench/lm.py --quick               # ~6 M parameters: a smoke run in about a minute
    python bench/lm.py --precision fp32 --threads 2
    python bench/lm.py --threads 1 --only lora --repeats 4   # fused LoRA layers against peft's
    python bench/lm.py --threads 1 --only kernels --repeats 4   # fused CPU kernels against transformers' layers
    python bench/lm.py --threads 1 --only layout --repeats 6    # column-major wide weights against row-major
    python bench/lm.py --threads 1 --only attention --repeats 6 # the attention kernel against eager attention
    python bench/lm.py --threads 1 --only amx --repeats 6       # LoRA's products on AMX against oneDNN's matmuls
    python bench/lm.py --threads 1 --only perf --hidden 896 --layers 4 --mlp 4864   # Qwen2.5-0.5B's layer shape
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import ppokit  # noqa: E402,F401  (before torch: its OpenMP settings, as in the CLI)


# ----------------------------------------------------------------------------- shared
def model_dir(a: argparse.Namespace) -> Path:
    from ppokit.lm.model.tiny import build_tiny_model

    path = Path(tempfile.gettempdir()) / f"ppokit-bench-lm-h{a.hidden}-l{a.layers}-m{a.mlp or 0}"
    return build_tiny_model(
        path,
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=a.hidden // 64,
        intermediate_size=a.mlp,
        max_position_embeddings=256,
        seed=0,
    )


def make_config(a: argparse.Namespace, mode: str, path: Path, use_cache: bool = True, cache: str = "dynamic"):
    from ppokit.config import build_config

    return build_config(
        [
            {
                "workload": "lm",
                "seed": 0,
                "model": {"path": str(path), "mode": mode},
                "rollout": {
                    "temperature": 1.0,
                    "max_new_tokens": a.response_len,
                    "micro_batch_size": a.batch,
                    "use_cache": use_cache,
                    "cache_implementation": cache,
                },
                "train": {
                    "iterations": 1,
                    "batch_size": a.batch,
                    "mini_batch_size": a.batch,
                    "micro_batch_size": a.micro,
                    "infer_micro_batch_size": a.micro,
                    "epochs": 1,
                    "learning_rate": 1e-5,
                },
                "algo": {"beta": 0.01, "group_size": 1},
                "run": {"precision": a.precision, "device": a.device, "progress": False, "tensorboard": False},
            }
        ]
    )


def prompts(a: argparse.Namespace) -> list[str]:
    from ppokit.lm.data.tasks import get_task

    return [x["prompt"] * a.prompt_repeat for x in get_task("arithmetic:digits=3").items("train", a.batch)]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


class Pieces:
    """The policy, rollout engine, scorer and learner of one configuration."""

    def __init__(self, a: argparse.Namespace, mode: str, use_cache: bool = True, cache: str = "dynamic"):
        import torch

        from ppokit.lm.generation.factory import make_engine
        from ppokit.lm.learner import LMLearner
        from ppokit.lm.model.device import placement
        from ppokit.lm.model.hf import load_tokenizer
        from ppokit.lm.model.policy import build_policy
        from ppokit.lm.scoring import Scorer
        from ppokit.persistence.resume import seed_globals

        path = model_dir(a)
        self.cfg = cfg = make_config(a, mode, path, use_cache, cache)
        if a.threads:
            torch.set_num_threads(a.threads)
        seed_globals(cfg.seed)
        self.device, self.dtype = placement(cfg)
        self.tok = load_tokenizer(path)
        self.policy = build_policy(cfg, path, device=self.device, autocast_dtype=self.dtype, seed=0)
        kv_cache = None
        if cfg.model.cpu_kernels:  # as the LM workload builds it
            from ppokit.lm.accel import accelerate_policy

            kv_cache = accelerate_policy(self.policy).kv_cache
        self.engine = make_engine(
            self.policy, self.tok, cfg.rollout, kv_cache=kv_cache, generation_kwargs={"min_new_tokens": a.response_len}
        )
        self.learner = LMLearner(cfg, self.policy, self.tok, path)
        # as the LM workload: a fully on-policy update (one epoch, one mini-batch) computes its own old log-probs
        self.scorer = Scorer(
            self.policy,
            cfg.train.infer_micro_batch_size,
            need_reference=True,
            need_old_log_prob=self.learner.needs_scored_old_log_prob(),
        )
        self.prompts = prompts(a)

    def training_batch(self, ro, scored: dict) -> dict:
        """The update's batch for rollout ``ro``: random sequence rewards in [0, 1), GAE."""
        import torch

        from ppokit.lm.scoring import token_rewards
        from ppokit.trainer import compute_advantages

        scores = torch.rand(len(ro), generator=torch.Generator().manual_seed(0)).to(self.device)
        rewards = token_rewards(scores, ro.mask)
        adv, ret = compute_advantages(self.cfg, rewards=rewards, mask=ro.mask, values=scored["old_values"])
        return {**ro.tensors(), **scored, "advantages": adv, "returns": ret}

    def score(self, ro) -> dict:
        return self.scorer.forward_passes(ro.tensors())

    def update(self, batch: dict) -> dict:
        return self.learner.trainer.update(batch, 0)

    def iteration(self) -> dict:
        t = {}
        start = time.perf_counter()
        ro = self.engine.generate(self.prompts, group_size=1)
        sync(self.device)
        t["generate"] = time.perf_counter() - start
        start = time.perf_counter()
        scored = self.score(ro)
        sync(self.device)
        t["score"] = time.perf_counter() - start
        batch = self.training_batch(ro, scored)
        start = time.perf_counter()
        self.update(batch)
        sync(self.device)
        t["update"] = time.perf_counter() - start
        t["total"] = t["generate"] + t["score"] + t["update"]
        return {"times": t, "rollout": ro}


# ----------------------------------------------------------------------------- FLOPs
def model_shapes(policy) -> dict:
    base = policy.lm.get_base_model() if hasattr(policy.lm, "get_base_model") else policy.lm
    c = base.config
    head = base.get_output_embeddings().weight.numel()
    emb = base.get_input_embeddings().weight.numel()
    body = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n) - head - emb
    return {"body": body, "hidden": c.hidden_size, "layers": c.num_hidden_layers, "vocab": c.vocab_size}


def forward_flops(s: dict, n: int, length: int, head_positions: int) -> float:
    """One forward pass over n sequences of ``length`` positions, lm_head at ``head_positions``."""
    linear = 2 * s["body"] * n * length
    attention = 4 * s["layers"] * s["hidden"] * n * length * length
    return linear + attention + 2 * s["hidden"] * s["vocab"] * n * head_positions


def iteration_flops(
    s: dict, n: int, prompt_len: int, response_len: int, mode: str, old_log_prob_pass: bool = True
) -> dict:
    """FLOPs of each phase; ``old_log_prob_pass``: whether scoring ran the actor (a fully
    on-policy update computes the old log-probs in its own forward instead)."""
    L = prompt_len + response_len
    actor = forward_flops(s, n, L, response_len)
    critic = forward_flops(s, n, L, 0)
    backward = 1.0 if mode == "lora" else 2.0  # frozen backbone: input gradients only
    update = (actor + critic) * (1 + backward)
    score = (2 if old_log_prob_pass else 1) * actor + critic  # [old log-probs,] reference, values
    # generation: prefill of the prompts, then one token per step against the cache
    gen = forward_flops(s, n, prompt_len, 1)
    for t in range(1, response_len):
        ctx = prompt_len + t
        gen += 2 * s["body"] * n + 4 * s["layers"] * s["hidden"] * n * ctx + 2 * s["hidden"] * s["vocab"] * n
    return {"generate": gen, "score": score, "update": update, "total": gen + score + update}


@cache
def square_operands(device, dtype, size: int):
    """Two random (size x size) matrices in the precision in use, made once for every
    ceiling measurement."""
    import torch

    dt = dtype or torch.float32
    return torch.randn(size, size, device=device).to(dt), torch.randn(size, size, device=device).to(dt)


def describe_machine() -> str:
    """The hardware the ratios belong to: the CPU's model and what runs its bf16 matmuls
    (AMX tiles on recent Intel CPUs, AVX512-BF16 vector instructions on AMD's Zen 4),
    and the GPU if there is one."""
    import platform

    import torch

    info = {}  # the first CPU's "model name" and "flags"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = info.get("model name") or platform.processor() or platform.machine()
    flags = f" {info['flags']} " if "flags" in info else ""
    units = (
        "AMX tiles"
        if " amx_bf16 " in flags
        else "AVX512-BF16 vector instructions"
        if " avx512_bf16 " in flags
        else "no bf16 instructions (fp32 is the default there)"
        if flags
        else "unknown units"
    )
    gpu = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"machine: {model}, {os.cpu_count()} CPU cores, bf16 matmuls on {units}{gpu}"


def matmul_ceiling(device, dtype, size: int = 2048, repeats: int = 10) -> float:
    """Best FLOP/s of a (size x size) @ (size x size) matmul in the precision in use."""
    import torch

    x, y = square_operands(device, dtype, size)
    best = float("inf")
    for _ in range(repeats + 2):
        sync(device)
        start = time.perf_counter()
        torch.matmul(x, y)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def sustained_matmul(device, dtype, seconds: float, size: int = 2048) -> tuple[float, float]:
    """(FLOPs, seconds) of (size x size) matmuls run back to back for at least ``seconds``.

    A phase of PPO lasts seconds; on a shared host the best single matmul (tens of
    milliseconds) runs faster than any seconds-long window of the same matmul, so the
    phases are compared with windows of back-to-back matmuls as long as each phase,
    run right after it (see :func:`child_perf`)."""
    import torch

    x, y = square_operands(device, dtype, size)
    torch.matmul(x, y)  # first-call set-up is not the machine's rate
    sync(device)
    n, start = 0, time.perf_counter()
    while True:
        torch.matmul(x, y)
        sync(device)
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2 * size**3 * n, elapsed


def layer_matmul_weights(policy) -> list:
    """The frozen weights of every linear layer in the first decoder layer (LoRA factors
    apart), [out, in] each, in the layout the policy stores them (see ppokit.lm.accel.weight_layout)."""
    from torch import nn

    base = policy.lm.get_base_model() if hasattr(policy.lm, "get_base_model") else policy.lm
    layer = base.model.layers[0]
    return [m.weight.detach() for name, m in layer.named_modules() if isinstance(m, nn.Linear) and "lora_" not in name]


def layer_matmul_rate(
    weights: list, rows: int, device, dtype, ceiling_size: int = 2048, repeats: int = 30
) -> tuple[float, float]:
    """(FLOP/s of the update's layer matmuls alone, FLOP/s of the ceiling matmul), best of
    ``repeats``, measured alternately so that both see the same load on the machine.

    The update's layer matmuls, per frozen weight W [out, in] (as the policy stores it)
    and micro-batch of ``rows`` tokens: the forward ``x W^T`` and the input gradient
    ``g W`` (the backbone is frozen, so there is no weight gradient). Nothing else: no
    LoRA, no elementwise work. Its rate is about the most an update made of these layers
    can reach (the attention and lm_head matmuls, a few per cent of the FLOPs, are left out)."""
    import torch

    dt = dtype or torch.float32
    inputs = {n: torch.randn(rows, n, device=device).to(dt) for w in weights for n in w.shape}

    def layer():
        for w in weights:
            inputs[w.shape[1]] @ w.t()
            inputs[w.shape[0]] @ w

    layer_time, ceiling = float("inf"), 0.0
    for _ in range(repeats):
        ceiling = max(ceiling, matmul_ceiling(device, dtype, ceiling_size, repeats=1))
        sync(device)
        start = time.perf_counter()
        layer()
        sync(device)
        layer_time = min(layer_time, time.perf_counter() - start)
    flops = sum(2 * 2 * rows * w.numel() for w in weights)
    return flops / layer_time, ceiling


# ----------------------------------------------------------------------------- children
def child_memory(a: argparse.Namespace) -> dict:
    import torch

    from ppokit.lm.model.device import resolve_device

    device = resolve_device(a.device)
    # Imports, lazily loaded modules and kernels are not the iteration's: warm up on a
    # tiny model of the same kind first, then take the baseline.
    warm = argparse.Namespace(**{**vars(a), "hidden": 64, "layers": 1, "batch": 2, "micro": 2})
    Pieces(warm, a.mode).iteration()
    import gc

    gc.collect()
    base = rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    pieces = Pieces(a, a.mode)
    pieces.iteration()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = peak_rss_bytes() - base
    params = sum(p.numel() for p in pieces.policy.parameters())
    return {"mode": a.mode, "peak_bytes": peak, "parameters_in_memory": params}


def child_perf(a: argparse.Namespace) -> dict:
    a = argparse.Namespace(**{**vars(a), "micro": a.perf_micro})  # a throughput-sized micro-batch
    pieces = Pieces(a, "lora")
    pieces.iteration()  # warm-up (allocations, kernels, Adam state)
    # Two ceilings. The peak: the best single matmul, measured before, between and after
    # the timed iterations (other processes only ever slow a measurement down). The
    # sustained one: after each phase of each iteration, matmuls back to back for as long
    # as that phase took, so that phases and ceiling are averaged over the same stretches
    # of the host's load. Phase times are means over the repeats, not the best, for the
    # same reason.
    peaks = [matmul_ceiling(pieces.device, pieces.dtype)]
    runs, windows = [], {"generate": [], "score": [], "update": []}
    for _ in range(a.repeats):
        runs.append(pieces.iteration())
        for phase, window in windows.items():
            window.append(sustained_matmul(pieces.device, pieces.dtype, runs[-1]["times"][phase]))
        peaks.append(matmul_ceiling(pieces.device, pieces.dtype))
    ro = runs[-1]["rollout"]
    s = model_shapes(pieces.policy)
    flops = iteration_flops(
        s, len(ro), ro.prompt_length, ro.responses.shape[1], "lora", old_log_prob_pass=pieces.scorer.need_old_log_prob
    )
    t = {k: sum(r["times"][k] for r in runs) / len(runs) for k in ("generate", "score", "update", "total")}
    sustained = {phase: sum(f for f, _ in w) / sum(sec for _, sec in w) for phase, w in windows.items()}
    sustained["total"] = sum(f for w in windows.values() for f, _ in w) / sum(
        sec for w in windows.values() for _, sec in w
    )
    rows = a.perf_micro * (ro.prompt_length + ro.responses.shape[1])
    matmuls, matmul_ceiling_ = layer_matmul_rate(layer_matmul_weights(pieces.policy), rows, pieces.device, pieces.dtype)
    return {
        "ceiling_flops": max(peaks),
        "sustained_flops": sustained,
        "flops": flops,
        "times": t,
        "shapes": s,
        "layer_matmuls": {"rows": rows, "fraction": matmuls / matmul_ceiling_},
        "precision": "bf16" if pieces.dtype is not None else "fp32",
        "device": str(pieces.device),
        "threads": __import__("torch").get_num_threads(),
        "old_log_prob_pass": pieces.scorer.need_old_log_prob,
        "tokens": {"n": len(ro), "prompt": ro.prompt_length, "response": ro.responses.shape[1]},
    }


def child_gen(a: argparse.Namespace) -> dict:
    out = {}
    for name, use_cache, cache_kind in (
        ("cache", True, "dynamic"),
        ("static", True, "static"),
        ("no_cache", False, "dynamic"),
    ):
        pieces = Pieces(a, "lora", use_cache=use_cache, cache=cache_kind)
        pieces.engine.generate(pieces.prompts, group_size=1)  # warm-up (on CUDA, the static cache compiles)
        best = float("inf")
        for _ in range(a.repeats):
            start = time.perf_counter()
            ro = pieces.engine.generate(pieces.prompts, group_size=1)
            sync(pieces.device)
            best = min(best, time.perf_counter() - start)
        out[name] = float(ro.mask.sum()) / best
    return out


def alternate(a: argparse.Namespace, paths: dict) -> dict:
    """Generation, score and update times for each of ``paths`` (name -> function that
    switches the policy to it), best of ``a.repeats`` rounds, alternating in one process
    (this machine's speed drifts more between processes than the paths differ)."""
    a = argparse.Namespace(**{**vars(a), "micro": a.perf_micro})
    pieces = Pieces(a, "lora")
    ro = pieces.engine.generate(pieces.prompts, group_size=1)
    batch = pieces.training_batch(ro, pieces.score(ro))
    times: dict[str, dict[str, float]] = {name: {} for name in paths}
    for round_ in range(a.repeats + 1):  # round 0 warms every path up
        for name, switch in paths.items():
            switch(pieces.policy)
            for phase, run in (
                ("generate", lambda: pieces.engine.generate(pieces.prompts, group_size=1)),
                ("score", lambda: pieces.score(ro)),
                ("update", lambda: pieces.update(batch)),
            ):
                start = time.perf_counter()
                run()
                sync(pieces.device)
                if round_:
                    elapsed = time.perf_counter() - start
                    times[name][phase] = min(times[name].get(phase, elapsed), elapsed)
    return times


def child_lora(a: argparse.Namespace) -> dict:
    """ppokit's fused LoRA layers against peft's own forward."""
    from ppokit.lm.accel.fused_lora import fuse_lora_layers, unfuse_lora_layers

    return alternate(
        a, {"fused": lambda policy: fuse_lora_layers(policy.lm), "peft": lambda policy: unfuse_lora_layers(policy.lm)}
    )


def child_kernels(a: argparse.Namespace) -> dict:
    """The fused CPU kernels (RMSNorm, SwiGLU, rotary) against transformers' layers."""
    from ppokit.lm.accel.kernels.fuse import fuse_cpu_kernels, unfuse_cpu_kernels

    return alternate(
        a,
        {
            "fused": lambda policy: fuse_cpu_kernels(policy.lm),
            "transformers": lambda policy: unfuse_cpu_kernels(policy.lm),
        },
    )


def child_layout(a: argparse.Namespace) -> dict:
    """Wide frozen bf16 weights stored column-major (ppokit.lm.accel.weight_layout) against row-major."""
    from peft.tuners.lora import Linear as LoraLinear

    from ppokit.lm.accel.weight_layout import transpose_wide_weights

    def row_major(policy) -> None:
        for module in policy.lm.modules():
            if isinstance(module, LoraLinear):
                weight = module.get_base_layer().weight
                weight.data = weight.data.contiguous()

    return alternate(a, {"column-major": lambda policy: transpose_wide_weights(policy.lm), "row-major": row_major})


def child_attention(a: argparse.Namespace) -> dict:
    """The attention kernel of training and scoring passes against eager attention (the
    other fused kernels on in both)."""
    from ppokit.lm.accel.kernels import fuse

    def up_to(keys: int):
        def switch(policy) -> None:
            fuse.ATTENTION_MAX_KEYS = keys

        return switch

    return alternate(a, {"kernel": up_to(fuse.ATTENTION_MAX_KEYS), "eager": up_to(0)})


def child_amx(a: argparse.Namespace) -> dict:
    """LoRA's rank-r products on ppokit's kernels (AMX or AVX512-BF16) against oneDNN's matmuls."""
    from ppokit.lm.accel.fused_lora import enable_lora_kernels

    def kernels(policy) -> None:
        if not enable_lora_kernels(policy.lm, True):
            raise SystemExit("--only amx: this CPU (or this build) has no LoRA kernels (AMX or AVX512-BF16)")

    return alternate(a, {"kernels": kernels, "oneDNN": lambda policy: enable_lora_kernels(policy.lm, False)})


def child_profile(a: argparse.Namespace) -> dict:
    """Where each phase's time goes: torch.profiler's operators by self time, per phase."""
    from torch.profiler import ProfilerActivity, profile

    a = argparse.Namespace(**{**vars(a), "micro": a.perf_micro})
    pieces = Pieces(a, "lora")
    pieces.iteration()  # warm-up
    ro = pieces.engine.generate(pieces.prompts, group_size=1)
    phases = {
        "generate": lambda: pieces.engine.generate(pieces.prompts, group_size=1),
        "score": lambda: pieces.score(ro),
    }
    scored = pieces.score(ro)
    phases["update"] = lambda: pieces.update(pieces.training_batch(ro, scored))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if pieces.device.type == "cuda" else [])
    sort = "self_cuda_time_total" if pieces.device.type == "cuda" else "self_cpu_time_total"
    out = {}
    for phase, fn in phases.items():
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            fn()
            sync(pieces.device)
        out[phase] = {
            "seconds": time.perf_counter() - start,
            "table": prof.key_averages().table(sort_by=sort, row_limit=a.rows or 25),
        }
    return out


CHILDREN = {
    "profile": child_profile,
    "memory": child_memory,
    "perf": child_perf,
    "gen": child_gen,
    "lora": child_lora,
    "kernels": child_kernels,
    "layout": child_layout,
    "attention": child_attention,
    "amx": child_amx,
}
# --only lora / kernels / layout / attention / amx: (ppokit's path, the path it is compared with)
ALTERNATIVES = {
    "lora": ("fused", "peft"),
    "kernels": ("fused", "transformers"),
    "layout": ("column-major", "row-major"),
    "attention": ("kernel", "eager"),
    "amx": ("kernels", "oneDNN"),
}


# ----------------------------------------------------------------------------- parent
def run_child(a: argparse.Namespace, kind: str, mode: str = "lora") -> dict:
    args = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--mode", mode]
    for key in (
        "hidden",
        "layers",
        "mlp",
        "batch",
        "micro",
        "perf_micro",
        "prompt_repeat",
        "response_len",
        "precision",
        "device",
        "threads",
        "repeats",
        "rows",
    ):
        value = getattr(a, key)
        if value is not None:
            args += [f"--{key.replace('_', '-')}", str(value)]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"bench child {kind}/{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a ~6 M-parameter model and fewer tokens")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 640; quick 256)")
    p.add_argument("--layers", type=int, default=None, help="layers (default 10; quick 6)")
    p.add_argument("--mlp", type=int, default=None, help="MLP size (default 8/3 x hidden, the Llama ratio)")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences per iteration, all in one generate call (default 256: 32 prompts x 8 "
        "samples, the issue's scale; quick 16)",
    )
    p.add_argument(
        "--micro", type=int, default=None, help="sequences per forward/backward (default 4, the PPO defaults' scale)"
    )
    p.add_argument(
        "--perf-micro",
        type=int,
        default=None,
        help="sequences per forward/backward in the FLOP/s and time measurements (default 32)",
    )
    p.add_argument("--prompt-repeat", type=int, default=2, help="prompt = an arithmetic problem repeated k times")
    p.add_argument("--response-len", type=int, default=None, help="response tokens (default 32; quick 16)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=2, help="timed repetitions (the best counts)")
    p.add_argument("--only", choices=sorted(CHILDREN), help="run one measurement")
    p.add_argument("--rows", type=int, default=None, help="operators per phase in --only profile (default 25)")
    p.add_argument("--json", help="also write every measurement to this file (bench/compare.py reads it)")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--mode", default="lora", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    quick = {"hidden": 256, "layers": 6, "batch": 16, "micro": 4, "perf_micro": 8, "response_len": 16}
    full = {"hidden": 640, "layers": 10, "batch": 256, "micro": 4, "perf_micro": 32, "response_len": 32}
    for key, value in (quick if a.quick else full).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.child:
        print(json.dumps(CHILDREN[a.child](a)))
        return 0

    model_dir(a)  # build once, before the children race to it
    print(describe_machine())
    print(
        f"model: hidden {a.hidden}, {a.layers} layers; {a.batch} sequences, responses of "
        f"{a.response_len} tokens; micro-batch {a.micro} (memory) / {a.perf_micro} (speed); "
        f"precision {a.precision}, device {a.device}"
    )
    ok = True
    report: dict[str, object] = {}
    if a.only in (None, "memory"):
        lora, full_ = run_child(a, "memory", "lora"), run_child(a, "memory", "full")
        report["memory"] = {"lora": lora, "full": full_}
        ratio = lora["peak_bytes"] / full_["peak_bytes"]
        ok &= ratio <= 0.4
        print(
            f"memory      shared-LoRA {lora['peak_bytes'] / 2**20:8.0f} MiB   separate models "
            f"{full_['peak_bytes'] / 2**20:8.0f} MiB   ratio {ratio:.3f}   (goal <= 0.4)"
        )
    if a.only in (None, "perf"):
        r = report["perf"] = run_child(a, "perf")
        params = r["shapes"]["body"]
        peak, sustained = r["ceiling_flops"], r["sustained_flops"]
        rate = {phase: r["flops"][phase] / r["times"][phase] for phase in ("generate", "score", "update", "total")}
        mfu = rate["update"] / sustained["update"]
        over = sustained["total"] / rate["total"]  # time over FLOPs at the sustained rate
        ok &= (mfu >= 0.4 or params < 20e6) and over <= 2
        print(
            f"ceiling     {r['precision']} matmul, {r['device']}, {r['threads']} threads: peak {peak / 1e12:.3f} "
            f"TFLOP/s (best single matmul); sustained {sustained['total'] / 1e12:.3f} TFLOP/s (back to back, "
            f"after each phase for as long as it took)"
        )
        passes = (
            "old log-probs, reference, values"
            if r["old_log_prob_pass"]
            else "reference, values (one epoch of one mini-batch: the update computes the old log-probs)"
        )
        print(
            f"            body {params / 1e6:.1f} M parameters; tokens {r['tokens']}; mean of {a.repeats} iterations; "
            f"scoring passes: {passes}"
        )
        for phase in ("generate", "score", "update"):
            print(
                f"  {phase:9s} {r['times'][phase]:7.3f} s  {r['flops'][phase] / 1e9:9.1f} GFLOP  "
                f"{rate[phase] / 1e12:.3f} TFLOP/s = {rate[phase] / sustained[phase]:6.1%} of the sustained ceiling "
                f"({sustained[phase] / 1e12:.3f}), {rate[phase] / peak:6.1%} of the peak"
            )
        print(
            f"update      {mfu:6.1%} of the sustained matmul ceiling, {rate['update'] / peak:.1%} of the peak   "
            f"(goal >= 40% for >= 20 M parameters)"
        )
        lm = r["layer_matmuls"]
        print(
            f"  bound     {lm['fraction']:6.1%}: the update's layer matmuls alone ({lm['rows']} rows, no LoRA, "
            "no elementwise work), measured alternately with the peak"
        )
        print(
            f"iteration   {r['times']['total']:.3f} s = {over:.2f}x its compute floor at the sustained ceiling "
            f"({r['flops']['total'] / sustained['total']:.3f} s), {peak / rate['total']:.2f}x at the peak   "
            f"(goal <= 2)"
        )
    if a.only == "profile":
        for phase, r in run_child(a, "profile").items():
            print(f"profile     {phase}: {r['seconds']:.3f} s under the profiler")
            print(r["table"])
    if a.only in ALTERNATIVES:
        t = report[a.only] = run_child(a, a.only)
        ours, other = ALTERNATIVES[a.only]
        for phase in ("generate", "score", "update"):
            print(
                f"{a.only:11s} {phase:8s} {ours} {t[ours][phase]:7.3f} s   {other} {t[other][phase]:7.3f} s   "
                f"{other}/{ours} {t[other][phase] / t[ours][phase]:.2f}x"
            )
    if a.only in (None, "gen"):
        g = report["gen"] = run_child(a, "gen")
        print(
            f"kv-cache    {g['cache']:8.0f} tokens/s with the cache, {g['no_cache']:8.0f} without: "
            f"{g['cache'] / g['no_cache']:.2f}x"
        )
        print(
            f"  static    {g['static']:8.0f} tokens/s with rollout.cache_implementation=static: "
            f"{g['static'] / g['cache']:.2f}x the dynamic cache"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
