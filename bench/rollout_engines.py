"""Rollout engines side by side: generated tokens/s, first-call time, mismatch with the scorer, memory.

A randomly initialised Qwen2 model built here (default: Qwen2.5-0.5B's shape, hidden 896,
24 layers, 14 heads, 2 KV heads, MLP 4864, a 32k vocabulary, the tiny model's character
tokenizer for the prompts; ``--small`` for a CPU smoke run) samples ``--prompts`` prompts
of ``--prompt-len`` tokens, ``--new`` tokens each, in each configuration:

    hf          transformers' generate, dynamic cache (the default engine)
    hf-static   transformers' generate, static cache (compiled on CUDA; lora, or fp32)
    cuda        ppokit's CUDA engine: folded weights, static cache, CUDA graphs on CUDA
    cuda-eager  the same without graphs (what the graphs buy)

for ``model.mode`` lora and full (the LoRA adapter random, so that folding it matters).
Per configuration: the first call (captures and compilation included), the median
tokens/s of the next ``--repeats`` calls (generated tokens up to EOS over wall time), the
mismatch between the engine's behaviour log-probs and the scorer's (``policy.log_probs``
on the same tokens): the mean per-token KL estimate ``mean(log p_engine - log p_scorer)``
and the largest ``|log p_engine - log p_scorer|``, and the engine's own memory.

    python bench/rollout_engines.py                      # on CUDA: the issue's shape
    python bench/rollout_engines.py --small --device cpu --prompts 16 --new 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

import ppokit  # noqa: E402,F401  (before torch: its OpenMP settings, as in the CLI)


def build_model(a: argparse.Namespace) -> Path:
    """A Qwen2 model of the requested shape with the tiny model's character tokenizer, saved as a
    Hugging Face directory (reused when it exists). The model samples from its whole vocabulary;
    ids the tokenizer does not know decode to nothing, which only the texts see."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ppokit.lm.model.tiny import build_char_tokenizer

    path = Path(tempfile.gettempdir()) / f"ppokit-bench-engines-h{a.hidden}-l{a.layers}-v{a.vocab}"
    if (path / "config.json").is_file():
        return path
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.mlp,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"  # as ppokit's tiny model saves it
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path


def make_policy(a: argparse.Namespace, path: Path, mode: str, cache: str):
    from ppokit.config import build_config
    from ppokit.lm.model.device import resolve_precision
    from ppokit.lm.model.policy import build_policy

    cfg = build_config(
        [
            {
                "workload": "lm",
                "model": {"path": str(path), "mode": mode},
                "rollout": {"max_new_tokens": a.new, "micro_batch_size": a.prompts, "cache_implementation": cache},
                "algo": {"adv_estimator": "grpo", "group_size": 2},
                "run": {"device": a.device, "precision": a.precision, "progress": False, "tensorboard": False},
            }
        ]
    )
    device = torch.device(a.device)
    dtype = resolve_precision(a.precision, device)
    policy = build_policy(cfg, path, device=device, autocast_dtype=dtype, seed=0, need_reference=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.adapter_parameters("actor") if mode == "lora" else ():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return cfg, policy


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(a: argparse.Namespace, path: Path, mode: str, engine_name: str) -> dict:
    from ppokit.lm.generation.cuda_engine import CudaEngine
    from ppokit.lm.generation.engine import HFEngine
    from ppokit.lm.model.hf import load_tokenizer

    cfg, policy = make_policy(a, path, mode, "static" if engine_name == "hf-static" else "dynamic")
    tok = load_tokenizer(path)
    if engine_name.startswith("hf"):
        engine = HFEngine.for_policy(policy, tok, cfg.rollout)
    else:
        engine = CudaEngine.for_policy(policy, tok, cfg.rollout, graphs=engine_name == "cuda" and a.device == "cuda")
    g = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    prompts = [
        "".join(letters[int(i)] for i in torch.randint(0, len(letters), (a.prompt_len - 1,), generator=g))
        for _ in range(a.prompts)
    ]  # + <bos>: prompt_len tokens each
    device = torch.device(a.device)
    times, tokens = [], []
    for _ in range(1 + a.repeats):
        sync(device)
        start = time.perf_counter()
        batch = engine.generate(prompts)
        sync(device)
        times.append(time.perf_counter() - start)
        tokens.append(float(batch.mask.sum()))
    with torch.no_grad():
        scored = policy.log_probs(batch.tensors())["log_prob"].float()  # (N, R) the scorer's
    diff = (batch.rollout_log_prob - scored)[batch.mask.bool()]
    memory = engine.memory()
    rates = [n / t for n, t in zip(tokens[1:], times[1:])]
    del engine, policy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "first_s": times[0],
        "tokens_per_s": statistics.median(rates),
        "kl": float(diff.mean()),
        "max_abs": float(diff.abs().max()),
        "engine_gb": (memory.weights + memory.cache) / 1e9,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--small", action="store_true", help="hidden 128, 4 layers, vocabulary 4096: a CPU smoke run")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="lora,full")
    p.add_argument("--engines", default=None, help="comma-separated (default: all that run on the device)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    a = p.parse_args(argv)
    shape = dict(hidden=128, layers=4, heads=4, kv_heads=2, mlp=352, vocab=4096)
    if not a.small:
        shape = dict(hidden=896, layers=24, heads=14, kv_heads=2, mlp=4864, vocab=32000)
    vars(a).update(shape)
    if a.threads:
        torch.set_num_threads(a.threads)
    engines = a.engines.split(",") if a.engines else ["hf", "hf-static", "cuda", "cuda-eager"]
    if a.device == "cpu" and not a.engines:
        engines = ["hf", "cuda-eager"]
    path = build_model(a)
    where = torch.cuda.get_device_name() if a.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"{where}; torch {torch.__version__}; Qwen2 hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}; "
        f"{a.prompts} prompts x ({a.prompt_len} + {a.new}) tokens; precision {a.precision}"
    )
    print(
        f"{'mode':5} {'engine':10} {'first call s':>12} {'tokens/s':>10} {'KL/token':>10} {'max |dlogp|':>11} "
        f"{'engine GB':>9}"
    )
    for mode in a.modes.split(","):
        for name in engines:
            if name == "hf-static" and mode == "full" and a.precision != "fp32":
                continue  # refused: fp32 keys beside bf16 values in a preallocated cache
            r = measure(a, path, mode, name)
            print(
                f"{mode:5} {name:10} {r['first_s']:12.2f} {r['tokens_per_s']:10.0f} {r['kl']:10.2e} "
                f"{r['max_abs']:11.2e} {r['engine_gb']:9.3f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
