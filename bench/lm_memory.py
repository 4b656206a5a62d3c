"""Peak memory of short LM runs on a model with a large vocabulary: LoRA and full mode, with and
without gradient checkpointing, each beside the pre-start estimate.

Each run is ``ppokit train arith`` (no warm start, no evaluations) on a random Qwen2-shaped
model built here (hidden 128, 2 layers, MLP 344, vocabulary 34,000, tied embeddings; the
tokenizer is :func:`gpu_check.byte_level_bpe`'s), 64 prompts of 64 tokens, 128 sampled
tokens, 2 mini-batches of 32, micro-batches of 32, float32, 3 iterations, in a process of
its own. Printed per run: the process's peak (``ru_maxrss``), the medians of iterations 2-3
of ``memory/peak_gb/<phase>`` and of the update's time, and the estimate of
:mod:`ppokit.lm.model.memory` for the same run; the last line is the JSON of every figure,
so that ``bench/compare.py`` can set two revisions side by side::

    python bench/lm_memory.py
    python bench/compare.py 0e94529 HEAD --rounds 1 -- python bench/lm_memory.py --only lora

A revision without the per-phase metric or the estimate (or the checkpointing field) reports
what it has.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import Shape, byte_level_bpe, prompt_records, qwen2_config, write_jsonl  # noqa: E402

SHAPE = Shape(hidden=128, layers=2, heads=4, kv_heads=2, mlp=344, vocab=34_000, tied=True)
PROMPTS, PROMPT_TOKENS, RESPONSE_TOKENS = 64, 64, 128
GB = 1e9
PHASES = ("generate", "score", "update")


def overrides(model_dir: Path, prompts: Path, mode: str, checkpointing: bool | None, threads: int) -> list[str]:
    args = [
        "data.sft_epochs=0",
        f"model.path={model_dir}",
        f"model.mode={mode}",
        f"data.prompts={prompts}",
        "data.reward=exact_match",
        "data.eval_size=0",
        f"rollout.max_new_tokens={RESPONSE_TOKENS}",
        "train.iterations=3",
        f"train.batch_size={PROMPTS}",
        f"train.mini_batch_size={PROMPTS // 2}",
        f"train.micro_batch_size={PROMPTS // 2}",
        f"train.infer_micro_batch_size={PROMPTS // 2}",
        "train.epochs=1",
        "run.precision=fp32",
        "run.device=cpu",
        f"run.torch_threads={threads}",
        "run.tensorboard=false",
        "run.progress=false",
    ]
    if checkpointing is not None:
        args.append(f"train.gradient_checkpointing={str(checkpointing).lower()}")
    return args


def estimate(args: list[str], model_dir: Path, checkpointing: bool) -> dict[str, float] | None:
    """The pre-start estimate of each phase in GB (None where this revision has no estimator)."""
    try:
        from ppokit.config import load_config
        from ppokit.lm.model.memory import estimate_memory, model_shape
    except ImportError:
        return None
    cfg = load_config("arith", args)
    est = estimate_memory(
        cfg,
        model_shape(str(model_dir)),
        prompt_tokens=PROMPT_TOKENS,
        bf16=False,
        device_type="cpu",
        checkpointing=checkpointing,
        eager_attention=True,
    )
    return {phase: est.phase_total(phase) / GB for phase in PHASES}


def run(args: list[str], out: Path) -> dict[str, float]:
    """One run in its own process: its peak and the medians of iterations 2.. of its metrics."""
    child = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(r.returncode)"
    )
    cmd = [sys.executable, "-c", child, sys.executable, "-m", "ppokit", "train", "arith", "--name", "run"]
    proc = subprocess.run(cmd + args + [f"run.output_dir={out}"], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"the run failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    result = {"process_peak_gb": int(proc.stdout.strip().splitlines()[-1]) / GB}
    for key in [f"memory/peak_gb/{p}" for p in PHASES] + ["time_update"]:
        if key in rows[0]:
            result[key] = statistics.median(r[key] for r in rows)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("lora", "full"), help="one model mode (both by default)")
    parser.add_argument("--threads", type=int, default=2)
    a = parser.parse_args()
    import torch
    from transformers import Qwen2ForCausalLM

    from ppokit.config import TrainConfig

    has_checkpointing = "gradient_checkpointing" in TrainConfig.model_fields
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer = byte_level_bpe(SHAPE.vocab)
        model_dir = work / "model"
        torch.manual_seed(0)
        Qwen2ForCausalLM(qwen2_config(SHAPE, tokenizer, PROMPT_TOKENS + RESPONSE_TOKENS)).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        prompts = write_jsonl(work / "prompts.jsonl", prompt_records(tokenizer, PROMPTS, PROMPT_TOKENS))
        for mode in [a.only] if a.only else ["lora", "full"]:
            for checkpointing in (False, True) if has_checkpointing else (None,):
                name = f"{mode}{'+checkpointing' if checkpointing else ''}"
                args = overrides(model_dir, prompts, mode, checkpointing, a.threads)
                start = time.perf_counter()
                result = run(args, work / name)
                est = estimate(args, model_dir, bool(checkpointing))
                if est is not None:
                    result.update({f"estimate_gb/{p}": v for p, v in est.items()})
                results[name] = result
                phases = " / ".join(f"{result.get(f'memory/peak_gb/{p}', float('nan')):.2f}" for p in PHASES)
                estimated = " / ".join(f"{v:.2f}" for v in est.values()) if est else "n/a"
                print(
                    f"{name:20s} process peak {result['process_peak_gb']:.2f} GB; generate / score / update "
                    f"{phases} GB (estimated {estimated}); update {result.get('time_update', float('nan')):.1f} s; "
                    f"{time.perf_counter() - start:.0f} s",
                    flush=True,
                )
    print(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
