"""A language-model resume that fails leaves the run as it was (see test_lm_resume.py for exact resume).

One small run (the test tiny Llama, no warm start, a checkpoint every iteration,
TensorBoard on) is copied and damaged per case; ``ppokit train --resume`` must exit 2
with one line naming the problem, and ``metrics.jsonl`` and ``tb/`` must be untouched.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from resume_helpers import copy_without_final_checkpoint

from ppokit.cli import main
from ppokit.persistence.rundir import read_metrics

ITERATIONS = 4


@pytest.fixture(scope="module")
def finished_run(tiny_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm-resume-errors")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8)))
    args = [
        "train",
        "arith",
        f"model.path={tiny_dir}",
        f"data.prompts={prompts}",
        "data.reward=exact_match",
        "data.sft_epochs=0",
        "data.eval_size=0",
        f"train.iterations={ITERATIONS}",
        "train.batch_size=8",
        "train.mini_batch_size=8",
        "train.micro_batch_size=8",
        "algo.group_size=4",
        "rollout.max_new_tokens=2",
        "run.precision=fp32",
        "run.checkpoint_every=1",
        "run.keep_checkpoints=3",
        f"run.tensorboard={'true' if _has_tensorboard() else 'false'}",
        "--output-dir",
        str(root),
        "--name",
        "run",
        "--no-progress",
    ]
    assert main(args) == 0
    return root / "run"


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    """A copy of the run, interrupted after 3 iterations (no final checkpoint)."""
    return copy_without_final_checkpoint(finished_run, tmp_path / "run")


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    files = [run_dir / "metrics.jsonl", *sorted((run_dir / "tb").rglob("*"))]
    return {str(f): f.read_bytes() for f in files if f.is_file()}


def _meta(ckpt: Path) -> Path:
    return ckpt / "meta.json"


def _set_iteration(ckpt: Path, value) -> None:
    body = json.loads(_meta(ckpt).read_text())
    body["iteration"] = value
    _meta(ckpt).write_text(json.dumps(body))


def _damage_prompts(run_dir: Path) -> None:
    cfg = json.loads(_meta(run_dir / "checkpoints" / "iter-000003").read_text())["config"]
    with open(cfg["data"]["prompts"], "a") as f:  # the prompt data changed since the checkpoint
        f.write(json.dumps({"prompt": "9+9=", "answer": "18"}) + "\n")


def _restore_prompts(run_dir: Path) -> None:
    cfg = json.loads(_meta(run_dir / "checkpoints" / "iter-000003").read_text())["config"]
    path = Path(cfg["data"]["prompts"])
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:8]))


LATEST = "checkpoints/iter-000003"
DAMAGES = {
    "adapter truncated": (
        lambda r: (r / LATEST / "actor" / "adapter_model.safetensors").write_bytes(
            (r / LATEST / "actor" / "adapter_model.safetensors").read_bytes()[:1000]
        ),
        "adapter_model.safetensors",
    ),
    "value head empty": (lambda r: (r / LATEST / "value_head.safetensors").write_bytes(b""), "value_head"),
    "critic missing": (lambda r: shutil.rmtree(r / LATEST / "critic"), "critic"),
    "policy.json broken": (lambda r: (r / LATEST / "policy.json").write_text("{"), "policy.json"),
    "prompt data changed": (_damage_prompts, "the prompt data changed since the checkpoint"),
}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_failing_resume_keeps_metrics_and_tensorboard(run, capsys, case):
    damage, message = DAMAGES[case]
    before = _snapshot(run)
    assert len(before) > 1 or not _has_tensorboard()
    damage(run)
    try:
        assert main(["train", "--resume", str(run), "run.progress=false"]) == 2
    finally:
        if case == "prompt data changed":
            _restore_prompts(run)
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err
    if case in ("adapter truncated", "value head empty"):  # a damaged file: what to do about it
        assert err.endswith(f"; move it out of the run directory to resume from {run / 'checkpoints'}/iter-000002"), err
    assert _snapshot(run) == before


@pytest.mark.parametrize("value", [-5, 99, 2, "3", True, None])
def test_a_corrupt_iteration_count_is_refused_and_names_another_checkpoint(run, capsys, value):
    before = _snapshot(run)
    _set_iteration(run / LATEST, value)
    assert main(["train", "--resume", str(run), "run.progress=false"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"checkpoint {run / LATEST} is corrupt" in err and "\n" not in err, err
    assert str(run / "checkpoints" / "iter-000002") in err
    assert _snapshot(run) == before


def test_a_corrupt_final_checkpoint_iteration_is_refused(finished_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    _set_iteration(run_dir / "checkpoint", ITERATIONS + 1)
    before = _snapshot(run_dir)
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"checkpoint {run_dir / 'checkpoint'} is corrupt" in err and "had already finished" not in err, err
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize("text", ["", "workload: [lm\n", "- a list\n"])
def test_resume_with_a_damaged_config_yaml_uses_the_checkpoints_config(run, capsys, text):
    (run / "config.yaml").write_text(text)
    assert main(["train", "--resume", str(run), "run.progress=false"]) == 0
    captured = capsys.readouterr()
    assert (
        f"{run / 'config.yaml'} is empty or not a ppokit config; using the config saved in "
        f"{run / LATEST / 'meta.json'}" in captured.err
    ), captured.err
    assert [r["iteration"] for r in read_metrics(run)] == list(range(ITERATIONS))


def test_resume_with_a_damaged_config_yaml_and_no_checkpoint_says_so(run, capsys):
    shutil.rmtree(run / "checkpoints")
    (run / "config.yaml").write_text("")
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no checkpoint, and its" in err and "config.yaml is empty or not a ppokit config" in err, err
