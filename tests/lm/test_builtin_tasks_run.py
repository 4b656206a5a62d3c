"""The built-in tasks run end to end through ``data.prompts``: Countdown (its prompts are longer
than the 64 positions of the default tiny model, which is then built with more) and a
GSM8K-format file scored by the ``math`` reward in the reward pool."""

from __future__ import annotations

import json

import pytest
from resume_helpers import read_rows

from ppokit.cli import main
from ppokit.lm.model.tiny import read_tiny_spec

COMMON = [
    "data.sft_epochs=0",
    "train.iterations=1",
    "train.batch_size=4",
    "train.mini_batch_size=4",
    "algo.group_size=2",
    "run.precision=fp32",
    "run.tensorboard=false",
    "run.torch_threads=1",
    "--no-progress",
]


@pytest.mark.slow
def test_countdown_on_the_built_in_tiny_model(tmp_path, capsys):
    args = [
        "train",
        "arith",
        "model.path=tiny",
        "data.prompts=countdown:num_count=3",
        "data.eval_size=2",
        "rollout.max_new_tokens=8",
        "--output-dir",
        str(tmp_path),
        "--name",
        "run",
        *COMMON,
    ]
    assert main(args) == 0
    spec = read_tiny_spec(tmp_path / "run" / "base_model")
    assert spec.max_position_embeddings > 64 and spec.max_position_embeddings % 64 == 0
    [row] = read_rows(tmp_path / "run")
    assert row["reward_errors"] == 0 and "eval_accuracy_after" in row
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].startswith("Using the numbers") and set(sample["fields"]) >= {"numbers", "target"}


@pytest.mark.slow
def test_gsm8k_format_file_with_the_math_reward(tiny_dir, tmp_path):
    data = tmp_path / "gsm.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"question": f"what is {i} and {i}?", "answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"}
            )
            + "\n"
            for i in range(1, 13)
        )
    )
    args = [
        "train",
        "arith",
        f"model.path={tiny_dir}",
        f"data.prompts=gsm8k:path={data},eval_fraction=0.3",
        "data.eval_size=4",
        "data.reward_workers=1",
        "rollout.max_new_tokens=4",
        "--output-dir",
        str(tmp_path),
        "--name",
        "run",
        *COMMON,
    ]
    assert main(args) == 0
    [row] = read_rows(tmp_path / "run")
    assert row["reward_errors"] == 0 and row["reward/verifier_mean"] >= 0 and "eval_accuracy_after" in row
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["fields"]["answer"] == str(int(sample["prompt"].split()[2]) * 2)
