"""One PPO iteration of SmolLM2-135M-Instruct on the CPU, phase by phase, against the machine's
own matmul rate and memory bandwidth, measured in the same process.

The run is an ordinary ``ppokit train CONFIG.yaml`` (called in this process, so its forward
passes can be watched), with the settings of a small GRPO run on a reasoning-gym-like task::

    model:   smollm2-135m-instruct (30-layer Llama, hidden 576, MLP 1536, 9 / 3 heads, vocabulary
             49,152, tied embeddings), model.mode=lora, rank 16 on every linear layer (the default
             targets), data.chat_template=true
    data:    a JSONL of "What is A + B? Give your final answer in <answer> </answer> tags." (A, B of
             three digits: every prompt has the same length), reward numeric_match
    rollout: 16 new tokens, temperature 0.7
    algo:    grpo, group_size 4; train: batch_size 32 (8 prompts x 4), micro-batch sizes auto,
             the other PPO settings ppokit's defaults (2 epochs, one mini-batch); run.precision auto

With 2 epochs the scorer runs the actor for the old log-probs, and without a KL term the reference
over the first 64 sequences for the ``kl_ref`` metric (here all 32): two forward passes. The update
runs a forward and a backward pass per micro-batch and epoch.

Per phase (the run's own ``time_generate``, ``time_score``, ``time_update`` from metrics.jsonl;
medians of iterations 2..N, the first one warms up):

``FLOPs``   counted from the model's shapes and the token counts of the passes the run made. A
            forward hook on the decoder records every pass (rows, new positions, cached positions,
            adapters on or off, gradients on or off); nothing in ppokit is changed. Matmuls only:
            frozen linear layers 2 * in * out per token; LoRA 2 * r * (in + out) per token where
            the actor adapter is on; attention 4 * keys * (heads * head_dim) per query token and
            layer (the dense rectangle, padding and the causal half included, as eager attention
            computes it); lm_head 2 * hidden * vocab per position it is applied to (generation:
            the last position of each row; scoring and update: the response positions). Backward
            (gradient passes): frozen layers the input gradient only (1x their forward), LoRA 2x,
            attention 2x, lm_head 2x (ppokit's chunked log-probs recompute the logits, then the
            input gradient). Elementwise work (norms, softmax, rotary, the optimizer) is not
            counted.
``rate``    the same matmuls timed with ``torch.matmul`` at the same shapes (rows = tokens of a
            pass or micro-batch, hidden 576 / MLP 1536 / vocab 49,152, attention as batched
            matmuls), in fp32 and, when the run uses bf16, in bf16; the best of a few repeats
            (on a shared host the best is the machine's rate). The phase's floor is the sum of
            those times; ``fraction`` = floor / phase time = achieved rate / measured rate, in
            the run's precision.
``decode``  generation's decoding steps against their own floor: the weights (every frozen
            parameter, the tied embedding read once as lm_head, the actor's LoRA factors) and the
            KV cache read once per step, at the read bandwidth measured here (the sum of a 256 MiB
            tensor; a copy is printed beside it). Step time = from one step's forward to the next
            (sampling and transformers' loop included), split into the decoder's forward, lm_head
            (a hook on it too) and the rest; the prefill's decoder and lm_head times beside it.

The hooks never raise into the run (an error ends the bench afterwards), and
``run.lm_head_calls_in_score_and_update`` (0) shows that scoring and the update took the
hidden-state log-prob path these counts assume.

The first lines print the CPU, the flags that decide its matmul paths (avx2, avx512f,
avx512_bf16, amx) and torch's thread count; the last line is the JSON of every figure::

    PPOKIT_CACHE=/tmp/ppc python bench/real_model.py   # SmolLM2, 4 iterations (~3 min on 2 cores)
    python bench/real_model.py --iterations 3 --threads 2 --json out.json
    python bench/real_model.py --profile     # also torch.profiler's top operators of each phase
                                             # of iteration 2 (then left out of the medians)
    python bench/real_model.py --smoke       # the built-in tiny model, 2 iterations, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import ppokit  # noqa: E402,F401  (before torch: its OpenMP settings, as in the CLI)

PHASES = ("generate", "score", "update")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
SMOLLM2 = "smollm2-135m-instruct"
ACTOR = "actor"  # ppokit.lm.model.policy.ACTOR: the adapter that generates and is trained


# ----------------------------------------------------------------------------- the machine
def machine() -> dict:
    """The CPU's model name, which of :data:`FLAGS` it has, its cores; torch's version."""
    import platform

    import torch

    info: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    flags = set(info.get("flags", "").split())
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "flags": {flag: flag in flags for flag in FLAGS},
        "cores": os.cpu_count(),
        "torch": torch.__version__,
    }


def best_seconds(fn, repeats: int = 5, sample: float = 0.02) -> float:
    """The best time of one call of ``fn`` over ``repeats`` samples, each at least ``sample``
    seconds of back-to-back calls (after a warm-up call)."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(sample / once))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def bandwidth(mib: int) -> dict:
    """Memory bandwidth in bytes/s: ``read`` (the sum of a ``mib`` MiB float32 tensor) and ``copy``
    (bytes read plus bytes written by a copy of it), best of a few."""
    import torch

    x = torch.rand(mib * 2**20 // 4)
    y = torch.empty_like(x)
    read = best_seconds(lambda: x.sum(), repeats=5, sample=0)
    copy = best_seconds(lambda: y.copy_(x), repeats=5, sample=0)
    return {"tensor_mib": mib, "read": x.nbytes / read, "copy": 2 * x.nbytes / copy}


# ----------------------------------------------------------------------------- the model
@dataclass
class Shape:
    """What the FLOP count needs of a decoder, read from the one the run trained."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    linears: list[tuple[int, int]]  # (in, out) of each frozen linear layer of one decoder layer
    loras: list[tuple[int, int, int]]  # (in, rank, out) of each actor adapter of one decoder layer
    weight_bytes: int = 0  # read once per decoding step: frozen weights, the head, the actor's LoRA

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    def linear_flops(self) -> int:  # per token, all layers
        return 2 * self.layers * sum(i * o for i, o in self.linears)

    def lora_flops(self) -> int:  # per token, all layers
        return 2 * self.layers * sum(r * (i + o) for i, r, o in self.loras)

    def attention_flops(self, keys: int) -> int:  # per query token with ``keys`` keys, all layers
        return 4 * self.layers * keys * self.q_width

    def head_flops(self) -> int:  # per position
        return 2 * self.hidden * self.vocab


def read_shape(decoder) -> Shape:
    """The :class:`Shape` of a transformers decoder (the ``LlamaModel`` inside peft's model)."""
    from torch import nn

    c = decoder.config
    layer = decoder.layers[0]
    linears, downs, ups = [], {}, {}
    for name, m in layer.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        if f"lora_A.{ACTOR}" in name:
            downs[name.split(".lora_A")[0]] = m
        elif f"lora_B.{ACTOR}" in name:
            ups[name.split(".lora_B")[0]] = m
        elif "lora_" not in name:
            linears.append((m.in_features, m.out_features))
    loras = [(downs[k].in_features, downs[k].out_features, ups[k].out_features) for k in downs if k in ups]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    weight_bytes = sum(
        p.numel() * p.element_size()
        for name, p in decoder.named_parameters()
        if "lora_" not in name or f".{ACTOR}." in name
    )
    return Shape(
        layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        heads=c.num_attention_heads,
        kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=head_dim,
        vocab=c.vocab_size,
        linears=linears,
        loras=loras,
        weight_bytes=weight_bytes,
    )


# ----------------------------------------------------------------------------- watching the run
@dataclass
class Pass:
    """One forward pass of the decoder, as the hooks saw it."""

    iteration: int
    phase: str
    rows: int
    new: int  # positions computed
    past: int  # positions already in the KV cache
    lora: bool  # the actor adapter on
    grad: bool
    threads: int  # torch's intra-op threads during the pass
    start: float
    end: float = 0.0
    head_rows: int = 0  # positions lm_head is applied to (set once the prompt length is known)
    head_s: float = 0.0  # generation: the time of the lm_head call after the pass

    @property
    def keys(self) -> int:
        return self.past + self.new


@dataclass
class Watcher:
    """Forward hooks on the run's decoder: each pass, its phase and iteration; the decoder itself.

    A global pre-hook finds the decoder (the first module called with ``embed_tokens`` and
    ``layers``), puts hooks on it and removes itself. Phases follow the run loop's order: passes
    with a KV cache are generation (a prefill after another phase starts an iteration); then
    passes without gradients are scoring, and from the first pass with gradients on, until the
    next generation, the update.
    """

    profile_iteration: int | None = None  # profile this iteration's phases (torch.profiler)
    passes: list[Pass] = field(default_factory=list)
    decoder: object = None
    lora_layer: object = None
    autocast: str = "fp32"
    kv_bytes: int = 4
    iteration: int = -1
    phase: str = "other"
    profiles: dict = field(default_factory=dict)
    _profiler: object = None
    _handles: list = field(default_factory=list)
    _found: object = None  # the global hook that finds the decoder and lm_head
    errors: list = field(default_factory=list)
    head_calls_outside_generation: int = 0
    _head_start: float = 0.0

    def install(self) -> None:
        from torch import nn
        from torch.nn.modules.module import register_module_forward_pre_hook

        @self._safe
        def find(module, args):
            # (this first call of the decoder is not recorded: a global hook sees no keyword arguments;
            # it is the policy's build-time check, before any iteration)
            if self.decoder is None and hasattr(module, "embed_tokens") and hasattr(module, "layers"):
                self._attach(module)
            elif (
                self.decoder is not None
                and isinstance(module, nn.Linear)
                and module.out_features == self.decoder.config.vocab_size
            ):  # lm_head (called in generation; scoring and the update use its weight directly)
                self._found.remove()
                self._found = None
                self._handles.append(module.register_forward_pre_hook(self._safe(self._head_pre)))
                self._handles.append(module.register_forward_hook(self._safe(self._head_post)))
                self._head_pre(module, args)

        self._found = register_module_forward_pre_hook(find)

    def _attach(self, decoder) -> None:
        self.decoder = decoder
        self.lora_layer = next((m for m in decoder.modules() if hasattr(m, "lora_A")), None)
        self._handles.append(decoder.register_forward_pre_hook(self._safe(self._pre), with_kwargs=True))
        self._handles.append(decoder.register_forward_hook(self._safe(self._post), with_kwargs=True))

    def _safe(self, hook):
        """``hook``, never raising into the run (an exception there would change what the run does:
        the policy's build-time check takes any failure for "use the general path"); its errors
        are kept and end the bench."""

        def safe(*args):
            try:
                hook(*args)
            except Exception as exc:  # noqa: BLE001 - reported after the run
                self.errors.append(f"{type(exc).__name__}: {exc}")

        return safe

    def _pre(self, module, args, kwargs):
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        generating = cache is not None or bool(kwargs.get("use_cache"))
        past = int(cache.get_seq_length()) if cache is not None else 0
        grad = torch.is_grad_enabled()
        if generating:
            if self.phase != "generate":
                self.iteration += 1
                self._switch("generate")
            phase = "generate"
            if past and cache is not None and getattr(cache, "layers", None):
                keys = getattr(cache.layers[0], "keys", None)
                if keys is not None:
                    self.kv_bytes = keys.element_size()
        elif grad or self.phase == "update":
            phase = "update"
        else:
            phase = "score"
        if phase != self.phase:
            self._switch(phase)
        if torch.is_autocast_enabled("cpu"):
            self.autocast = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(torch.get_autocast_dtype("cpu"), "fp32")
        lora = self.lora_layer is not None and not self.lora_layer.disable_adapters
        self.passes.append(
            Pass(
                self.iteration,
                phase,
                ids.shape[0],
                ids.shape[1],
                past,
                lora,
                grad,
                torch.get_num_threads(),
                time.perf_counter(),
            )
        )

    def _post(self, module, args, kwargs, output):
        if self.passes and not self.passes[-1].end:  # (the first call was not recorded: see install)
            self.passes[-1].end = time.perf_counter()

    def _head_pre(self, module, args):
        self._head_start = time.perf_counter()

    def _head_post(self, module, args, output):
        if self.passes and self.passes[-1].phase == "generate":
            self.passes[-1].head_s += time.perf_counter() - self._head_start
        elif self.iteration >= 0:
            self.head_calls_outside_generation += 1  # a run on the full-logits path

    def _switch(self, phase: str) -> None:
        """Phase ``phase`` starts: with ``--profile``, one profiler per phase of the profiled iteration."""
        self.phase = phase
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self.profiles[self._profiler.phase] = self._profiler
            self._profiler = None
        if self.iteration == self.profile_iteration:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU])
            self._profiler.phase = phase
            self._profiler.__enter__()

    def close(self) -> None:
        self._switch("other")
        for handle in self._handles + ([self._found] if self._found is not None else []):
            handle.remove()
        self._handles.clear()


# ----------------------------------------------------------------------------- the run
def write_prompts(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` records {"prompt": "What is A + B? ...", "answer": "A+B"}, A and B of three digits."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            prompt = f"What is {a} + {b}? Give your final answer in <answer> </answer> tags."
            f.write(json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n")
    return path


def write_config(a: argparse.Namespace, work: Path) -> Path:
    import yaml

    config = {
        "workload": "lm",
        "seed": 0,
        "model": {"path": a.model, "mode": "lora", "lora_rank": 16},
        "data": {
            "prompts": str(write_prompts(work / "prompts.jsonl", 256)),
            "reward": "numeric_match",
            "chat_template": a.model != "tiny",  # the built-in tiny model has no chat template
        },
        "rollout": {"max_new_tokens": a.new_tokens, "temperature": 0.7},
        "algo": {"adv_estimator": "grpo", "group_size": a.group},
        "train": {"iterations": a.iterations, "batch_size": a.prompts * a.group},
        "run": {
            "precision": a.precision,
            "device": "cpu",
            "output_dir": str(work / "runs"),
            "tensorboard": False,
            "progress": False,
        },
    }
    if a.threads:
        config["run"]["torch_threads"] = a.threads
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def train(config: Path, watcher: Watcher) -> list[dict]:
    """``ppokit train CONFIG`` in this process (its output on stderr), watched; metrics.jsonl's rows."""
    from ppokit.cli import main

    watcher.install()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            status = main(["train", str(config)])
    finally:
        watcher.close()
    if status:
        sys.exit(f"ppokit train {config} failed (exit status {status})")
    if watcher.errors:
        sys.exit(f"the bench's hooks failed {len(watcher.errors)} times: {watcher.errors[0]}")
    (metrics,) = (config.parent / "runs").rglob("metrics.jsonl")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


# ----------------------------------------------------------------------------- FLOPs and floors
class Rates:
    """Seconds of the matmuls of each part of a pass at its shapes (:meth:`pass_seconds`), timed
    with ``torch.matmul`` in one precision and kept by shape."""

    def __init__(self, shape: Shape, dtype):
        self.s, self.dtype, self.cache = shape, dtype, {}

    def _time(self, key: tuple, make) -> float:
        if key not in self.cache:
            self.cache[key] = best_seconds(make(), repeats=3 if key[1] >= 512 else 5)
        return self.cache[key]

    def _rand(self, *shape):
        import torch

        return torch.randn(*shape).to(self.dtype)

    def linear(self, rows: int, backward: bool) -> float:
        """One decoder layer's frozen linear layers: x W (forward) or g W^T (input gradient)."""

        def make():
            pairs = [((o, i) if backward else (i, o)) for i, o in self.s.linears]
            xs = {k: self._rand(rows, k) for k in {p[0] for p in pairs}}
            ws = [self._rand(*p) for p in pairs]
            return lambda: [xs[w.shape[0]] @ w for w in ws]

        return self._time(("linear", rows, backward), make)

    def lora(self, rows: int, backward: bool) -> float:
        """One layer's actor adapters: x A^T B^T; backward g B, (g B) A, (g B)^T x, g^T (x A^T)."""

        def make():
            import torch

            ops = []
            for i, r, o in self.s.loras:
                x, g, h = self._rand(rows, i), self._rand(rows, o), self._rand(rows, r)
                down, up = self._rand(i, r), self._rand(r, o)
                if backward:
                    ops += [(g, up.t()), (h, down.t()), (h.t(), x), (g.t(), h)]
                else:
                    ops += [(x, down), (h, up)]
            return lambda: [torch.matmul(p, q) for p, q in ops]

        return self._time(("lora", rows, backward), make)

    def attention(self, n: int, new: int, keys: int, backward: bool) -> float:
        """One layer's attention matmuls as batched matmuls over rows x heads: Q K^T and P V;
        backward dO V^T, P^T dO, dS K, dS^T Q."""

        def make():
            b, d = n * self.s.heads, self.s.head_dim
            q, k, p, o = self._rand(b, new, d), self._rand(b, keys, d), self._rand(b, new, keys), self._rand(b, new, d)
            if backward:
                ops = [(o, k.transpose(1, 2)), (p.transpose(1, 2), o), (p, k), (p.transpose(1, 2), q)]
            else:
                ops = [(q, k.transpose(1, 2)), (p, k)]
            import torch

            return lambda: [torch.matmul(x, y) for x, y in ops]

        return self._time(("attention", n * new, n, keys, backward), make)

    def head(self, rows: int, backward: bool) -> float:
        """lm_head: h E^T (rows x vocab); backward dz E."""

        def make():
            h = self._rand(rows, self.s.vocab if backward else self.s.hidden)
            w = self._rand(self.s.vocab, self.s.hidden)
            return (lambda: h @ w) if backward else (lambda: h @ w.t())

        return self._time(("head", rows, backward), make)

    def pass_parts(self, p: Pass) -> dict[str, float]:
        """Seconds of the matmuls of pass ``p`` (and its backward, for a pass with gradients) at
        this rate, by part: frozen linear layers, LoRA, attention, lm_head."""
        s, tokens = self.s, p.rows * p.new
        parts = {
            "linear": s.layers * self.linear(tokens, False),
            "lora": s.layers * self.lora(tokens, False) if p.lora and s.loras else 0.0,
            "attention": s.layers * self.attention(p.rows, p.new, p.keys, False),
            "head": self.head(p.head_rows, False),
        }
        if p.grad:
            parts["linear"] += s.layers * self.linear(tokens, True)
            parts["lora"] += s.layers * self.lora(tokens, True) if s.loras else 0.0
            parts["attention"] += s.layers * self.attention(p.rows, p.new, p.keys, True)
            parts["head"] += self.head(p.head_rows, False) + self.head(p.head_rows, True)  # recomputed, then dz E
        return parts

    def pass_seconds(self, p: Pass) -> float:
        return sum(self.pass_parts(p).values())


def pass_flops(s: Shape, p: Pass) -> float:
    """Matmul FLOPs of pass ``p`` (module docstring), backward included for a pass with gradients."""
    tokens = p.rows * p.new
    forward = tokens * (s.linear_flops() + s.attention_flops(p.keys)) + p.head_rows * s.head_flops()
    lora = tokens * s.lora_flops() if p.lora else 0
    backward = 0
    if p.grad:
        backward = tokens * (s.linear_flops() + 2 * s.attention_flops(p.keys)) + 2 * p.head_rows * s.head_flops()
        backward += 2 * tokens * s.lora_flops()
    return forward + lora + backward


def set_head_rows(passes: list[Pass]) -> dict[int, dict]:
    """lm_head positions of every pass; per iteration its prompt width P and response width R.
    Generation applies lm_head to each row's last position; scoring and the update to the R
    response positions of each row (the pass's width minus the prompt's)."""
    shapes: dict[int, dict] = {}
    for p in passes:
        if p.phase == "generate":
            it = shapes.setdefault(p.iteration, {"prompt": 0, "steps": 0, "rows": p.rows})
            if p.past:
                it["steps"] += 1
            else:
                it["prompt"] = p.new
            p.head_rows = p.rows
    for p in passes:
        if p.phase in ("score", "update") and p.iteration in shapes:
            shapes[p.iteration]["response"] = p.new - shapes[p.iteration]["prompt"]
            p.head_rows = p.rows * max(p.new - shapes[p.iteration]["prompt"], 0)
    return shapes


def decode_steps(s: Shape, passes: list[Pass], kv_bytes: int, read_bw: float, rates: Rates) -> dict:
    """Decoding steps: wall time per step (one step's forward to the next one's), the decoder's
    forward alone, and both floors (bytes read at ``read_bw``, matmuls at ``rates``); medians."""
    steps, forwards, heads, memory, compute, nbytes, parts = [], [], [], [], [], [], []
    for p, nxt in zip(passes, passes[1:] + [None]):
        if p.phase != "generate" or not p.past:
            continue
        if nxt is not None and nxt.phase == "generate" and nxt.past == p.past + p.new:
            steps.append(nxt.start - p.start)
        forwards.append(p.end - p.start)
        heads.append(p.head_s)
        kv = 2 * s.layers * p.rows * s.kv_heads * s.head_dim * p.keys * kv_bytes
        nbytes.append(s.weight_bytes + kv)
        memory.append(nbytes[-1] / read_bw)
        parts.append(rates.pass_parts(p))
        compute.append(sum(parts[-1].values()))
    if not forwards:
        return {}
    step = statistics.median(steps) if steps else statistics.median(forwards)
    floor, compute_floor = statistics.median(memory), statistics.median(compute)
    return {
        "steps": len(forwards),
        "rows": passes[-1].rows if passes else 0,
        "step_s": step,
        "forward_s": statistics.median(forwards),
        "head_s": statistics.median(heads),
        "rest_s": step - statistics.median(forwards) - statistics.median(heads),
        "bytes_per_step": statistics.median(nbytes),
        "memory_floor_s": floor,
        "step_over_memory_floor": step / floor,
        "compute_floor_s": compute_floor,
        "compute_floor_parts_s": {k: statistics.median(x[k] for x in parts) for k in parts[0]},
        "step_over_compute_floor": step / compute_floor,
    }


# ----------------------------------------------------------------------------- report
def analyse(a: argparse.Namespace, watcher: Watcher, rows: list[dict]) -> dict:
    import torch

    s = read_shape(watcher.decoder)
    shapes = set_head_rows(watcher.passes)
    iterations = sorted({p.iteration for p in watcher.passes if p.iteration >= 0})
    # the run's own thread count (set once the model is built; a check pass may come before)
    threads = statistics.mode(p.threads for p in watcher.passes if p.iteration >= 0)
    torch.set_num_threads(threads)
    if len(iterations) != len(rows):
        sys.exit(f"saw {len(iterations)} iterations' passes but metrics.jsonl has {len(rows)} rows")
    measured = [i for i in iterations[1:] if i != watcher.profile_iteration] or iterations[-1:]
    dtypes = {"fp32": torch.float32}
    if watcher.autocast == "bf16":
        dtypes["bf16"] = torch.bfloat16
    rates = {name: Rates(s, dt) for name, dt in dtypes.items()}
    bw = bandwidth(a.bandwidth_mib)
    run_rates = rates[watcher.autocast if watcher.autocast in rates else "fp32"]

    per_iteration = []
    for i in measured:
        row = rows[i]
        entry = {"iteration": i + 1, **shapes.get(i, {})}
        for phase in PHASES:
            passes = [p for p in watcher.passes if p.iteration == i and p.phase == phase]
            flops = sum(pass_flops(s, p) for p in passes)
            floors = {name: sum(r.pass_seconds(p) for p in passes) for name, r in rates.items()}
            seconds = row[f"time_{phase}"]
            entry[phase] = {
                "time_s": seconds,
                "flops": flops,
                "passes": len(passes),
                "tokens": sum(p.rows * p.new for p in passes),
                "forward_s": sum(p.end - p.start for p in passes),
                "floor_s": floors,
            }
            if phase == "generate" and passes:
                entry[phase]["prefill_s"] = sum(p.end - p.start for p in passes if not p.past)
                entry[phase]["prefill_head_s"] = sum(p.head_s for p in passes if not p.past)
                entry[phase]["span_s"] = passes[-1].end + passes[-1].head_s - passes[0].start
            entry[phase]["floor_parts_s"] = {
                k: sum(run_rates.pass_parts(p)[k] for p in passes) for k in ("linear", "lora", "attention", "head")
            }
        entry["gen_tokens_per_s"] = row.get("gen_tokens_per_s")
        entry["reward_mean"] = row.get("reward_mean")
        entry["response_length"] = row.get("response_length")
        per_iteration.append(entry)

    phases = {}
    for phase in PHASES:
        es = [e[phase] for e in per_iteration]
        seconds = statistics.median(e["time_s"] for e in es)
        flops = statistics.median(e["flops"] for e in es)
        out = {
            "time_s": seconds,
            "flops": flops,
            "achieved_flops_per_s": flops / seconds,
            "passes": es[-1]["passes"],
            "tokens": statistics.median(e["tokens"] for e in es),
            "forward_s": statistics.median(e["forward_s"] for e in es),
        }
        for name in rates:
            floor = statistics.median(e["floor_s"][name] for e in es)
            out[f"rate_{name}"] = flops / floor if floor else 0.0
            out[f"floor_s_{name}"] = floor
        key = watcher.autocast if watcher.autocast in rates else "fp32"
        out["rate"] = out[f"rate_{key}"]
        out["fraction"] = out["floor_s_" + key] / seconds
        out["floor_parts_s"] = {k: statistics.median(e["floor_parts_s"][k] for e in es) for k in es[0]["floor_parts_s"]}
        phases[phase] = out
    for key in ("prefill_s", "prefill_head_s", "span_s"):
        phases["generate"][key] = statistics.median(e["generate"].get(key, 0.0) for e in per_iteration)
    gen = [p for p in watcher.passes if p.iteration in measured and p.phase == "generate"]
    phases["generate"]["decode"] = decode_steps(s, gen, watcher.kv_bytes, bw["read"], run_rates)
    phases["generate"]["gen_tokens_per_s"] = statistics.median(
        e["gen_tokens_per_s"] for e in per_iteration if e["gen_tokens_per_s"] is not None
    )
    update_passes = [p for p in watcher.passes if p.iteration == measured[-1] and p.phase == "update"]
    score_passes = [p for p in watcher.passes if p.iteration == measured[-1] and p.phase == "score"]
    return {
        "machine": {**machine(), "torch_threads": threads},
        "run": {
            "model": a.model,
            "precision": watcher.autocast,
            "sequences": a.prompts * a.group,
            "prompts": a.prompts,
            "group_size": a.group,
            "max_new_tokens": a.new_tokens,
            "iterations": len(iterations),
            "measured_iterations": [i + 1 for i in measured],
            "update_micro_batch_rows": [p.rows for p in update_passes],
            "score_passes": [{"rows": p.rows, "adapter": p.lora} for p in score_passes],
            # 0: scoring and the update take log-probs from hidden states (lm_head's weight, chunked),
            # as counted here; more: the run took the full-logits path
            "lm_head_calls_in_score_and_update": watcher.head_calls_outside_generation,
        },
        "model": {
            "layers": s.layers,
            "hidden": s.hidden,
            "heads": s.heads,
            "kv_heads": s.kv_heads,
            "vocab": s.vocab,
            "linear_flops_per_token": s.linear_flops(),
            "lora_flops_per_token": s.lora_flops(),
            "weight_bytes": s.weight_bytes,
            "kv_cache_bytes_per_value": watcher.kv_bytes,
        },
        "bandwidth": bw,
        "phases": phases,
        "iterations": per_iteration,
    }


def table(r: dict) -> str:
    m, run, ph = r["machine"], r["run"], r["phases"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in m["flags"].items())
    precision = run["precision"]
    lines = [
        f"CPU: {m['cpu']}, {m['cores']} cores; flags: {flags}; torch {m['torch']}, {m['torch_threads']} threads",
        f"run: {run['model']}, {run['sequences']} sequences ({run['prompts']} prompts x {run['group_size']}), "
        f"{run['max_new_tokens']} new tokens, precision {precision}; medians of iterations "
        f"{', '.join(map(str, run['measured_iterations']))} of {run['iterations']}; update micro-batches "
        f"{run['update_micro_batch_rows']} rows; scoring passes "
        + ", ".join(f"{p['rows']} rows ({'actor' if p['adapter'] else 'reference'})" for p in run["score_passes"]),
        f"memory bandwidth: read {r['bandwidth']['read'] / 1e9:.1f} GB/s, copy {r['bandwidth']['copy'] / 1e9:.1f} GB/s",
        "",
        f"{'phase':9s} {'time s':>8s} {'GFLOP':>8s} {'GFLOP/s':>8s}  {'matmul GFLOP/s at these shapes':>31s}  "
        f"{'fraction':>8s}  floor s",
    ]
    for phase in PHASES:
        p = ph[phase]
        rate = f"fp32 {p['rate_fp32'] / 1e9:7.1f}" + (f"  bf16 {p['rate_bf16'] / 1e9:7.1f}" if "rate_bf16" in p else "")
        lines.append(
            f"{phase:9s} {p['time_s']:8.3f} {p['flops'] / 1e9:8.1f} {p['achieved_flops_per_s'] / 1e9:8.1f}  "
            f"{rate:>31s}  {p['fraction']:8.1%}  {p['floor_s_' + ('bf16' if 'rate_bf16' in p else 'fp32')]:.3f} = "
            + " + ".join(f"{k} {v:.3f}" for k, v in p["floor_parts_s"].items())
        )
    d = ph["generate"].get("decode")
    lines += [f"(floor s: the phase's matmuls at torch.matmul's {precision} rate at the same shapes, by part)"]
    if d:
        lines += [
            "",
            f"decoding step ({d['rows']} rows, median of {d['steps']}): {d['step_s'] * 1e3:.1f} ms = decoder "
            f"{d['forward_s'] * 1e3:.1f} + lm_head {d['head_s'] * 1e3:.1f} + sampling and transformers' loop "
            f"{d['rest_s'] * 1e3:.1f} ms; {ph['generate']['gen_tokens_per_s']:.0f} generated tokens/s",
            f"  memory floor: {d['bytes_per_step'] / 1e6:.0f} MB read (weights + KV cache) = "
            f"{d['memory_floor_s'] * 1e3:.1f} ms at the read bandwidth -> step {d['step_over_memory_floor']:.1f}x",
            f"  its matmuls at torch.matmul's {precision} rate: {d['compute_floor_s'] * 1e3:.1f} ms ("
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in d["compute_floor_parts_s"].items())
            + f") -> step {d['step_over_compute_floor']:.2f}x",
        ]
    g = ph["generate"]
    lines.append("")
    lines.append(
        f"generate: prefill decoder {g['prefill_s']:.3f} s + its lm_head {g['prefill_head_s']:.3f} s; "
        f"first pass to last {g['span_s']:.3f} s; before and after the passes {g['time_s'] - g['span_s']:.3f} s"
    )
    lines.append(
        "forward passes alone (decoder, hooks): "
        + ", ".join(f"{phase} {ph[phase]['forward_s']:.3f} s of {ph[phase]['time_s']:.3f} s" for phase in PHASES)
    )
    return "\n".join(lines)


def print_profiles(watcher: Watcher, rows: int) -> None:
    for phase in PHASES:
        prof = watcher.profiles.get(phase)
        if prof is not None:
            print(f"\nprofile of iteration {watcher.profile_iteration + 1}, {phase} (operators by self CPU time):")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--smoke", action="store_true", help="the built-in tiny model, 2 iterations (seconds)")
    p.add_argument("--model", default=None, help=f"model.path (default {SMOLLM2}; --smoke: tiny)")
    p.add_argument("--iterations", type=int, default=None, help="PPO iterations (default 4; --smoke 2)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per iteration (default 8)")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--new-tokens", type=int, default=16, help="rollout.max_new_tokens (default 16)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--threads", type=int, default=None, help="run.torch_threads (default: the run's own)")
    p.add_argument("--profile", action="store_true", help="torch.profiler's operators of iteration 2, per phase")
    p.add_argument("--rows", type=int, default=20, help="operators per phase with --profile (default 20)")
    p.add_argument("--json", help="also write the JSON to this file")
    a = p.parse_args(argv)
    a.model = a.model or ("tiny" if a.smoke else SMOLLM2)
    a.iterations = a.iterations or (2 if a.smoke else 4)
    a.bandwidth_mib = 64 if a.smoke else 256
    if a.profile and a.iterations < 3:
        p.error("--profile needs --iterations 3 or more (iteration 2 is profiled and left out of the medians)")
    started = time.perf_counter()
    watcher = Watcher(profile_iteration=1 if a.profile else None)
    with tempfile.TemporaryDirectory(prefix="ppokit-real-model-") as tmp:
        rows = train(write_config(a, Path(tmp)), watcher)
        trained = time.perf_counter() - started
        result = analyse(a, watcher, rows)
    result["wall_s"] = {"train": trained, "total": time.perf_counter() - started}
    print(table(result))
    if a.profile:
        print_profiles(watcher, a.rows)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
