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


def test_the_byte_level_bpe_has_the_asked_size_and_prompts_their_token_count():
    tok = gpu_check.byte_level_bpe(17_000)
    assert len(tok) == 17_000 and tok.eos_token_id == 16_999 == tok.pad_token_id
    records = gpu_check.prompt_records(tok, 5, 12, seed=3)
    for record in records:
        assert len(tok(record["prompt"])["input_ids"]) == 12 and record["prompt"].isprintable()
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
    }
    text = gpu_check.report(results)
    assert text.splitlines()[0].startswith("GPU check on NVIDIA H100 80GB HBM3 (79 GiB)")
    assert "| 0.5B-shaped lora, engine hf | 1.50 | 0.50 | 0.25 | 0.50 | 32,768 | 11.9 | 20.0 | 1.20e-04 |" in text
    assert "| 7B-shaped lora | error: out of memory |" in text
    assert "0.5B-shaped lora, engine cuda: generation 3.00x, iteration 2.00x the HF engine's" in text
    assert "40 passed, 1 failed" in text and "FAILED tests/x.py::t" in text
    assert "demo: held-out accuracy: 34.8% -> 98.0% (129 s)" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_a_gpu_it_says_to_use_smoke():
    done = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "--smoke" in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_smoke_check_runs_the_bench_and_the_7b_step_end_to_end(tmp_path):
    out = tmp_path / "results.json"
    command = [sys.executable, "bench/gpu_check.py", "--smoke", "--only", "bench", "7b", "--json", str(out)]
    command += ["--workdir", str(tmp_path / "work")]
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
