"""Exact resume of the language-model workload (see tests/control/test_control_resume.py for control).

A small seeded run on the test tiny Llama (a one-epoch warm start into
``RUN_DIR/base_model``, LoRA actor + critic, GAE, an adaptive in-reward KL coefficient,
held-out evaluations) runs as ``python -m ppokit train`` in subprocesses that are killed
(SIGKILL right after a metrics row, i.e. most likely inside the checkpoint write that
follows it; SIGTERM for the graceful path) and resumed; ``metrics.jsonl`` must equal an
uninterrupted run's row by row (every field but the timing fields in :data:`TIMING`,
floats bit for bit) and the final adapters, value head, optimizer and KL state must be
``torch.equal``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from resume_helpers import (
    LM_TIMING_KEYS,
    assert_same_metrics,
    poison_value_loss,
    read_rows,
    sigterm_run,
    start_and_wait,
    subprocess_env,
    train_cmd,
)
from safetensors.torch import load_file

from ppokit.cli import main
from ppokit.persistence import checkpoint, rundir

# Differ between any two runs (wall-clock times and rates); every other field must match.
TIMING = LM_TIMING_KEYS
ITERATIONS = 7
TRAINED_FILES = ("actor/adapter_model.safetensors", "critic/adapter_model.safetensors", "value_head.safetensors")


@pytest.fixture(scope="module")
def config(tiny_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm-resume")
    reward = root / "digits.py"
    reward.write_text("def digits(prompt, response, **fields):\n    return sum(c.isdigit() for c in response) / 4\n")
    cfg = {
        "workload": "lm",
        "seed": 3,
        "model": {"path": str(tiny_dir), "mode": "lora", "lora_rank": 4, "lora_alpha": 8},
        "data": {
            "prompts": "arithmetic:digits=1",
            "reward": f"{reward}:digits",
            "sft_epochs": 1,
            "sft_examples": 16,
            "sft_batch_size": 8,
            "eval_size": 8,
            "eval_every": 2,
        },
        "rollout": {"temperature": 1.0, "max_new_tokens": 4, "micro_batch_size": 8},
        "train": {
            "iterations": ITERATIONS,
            "batch_size": 8,
            "mini_batch_size": 4,
            "micro_batch_size": 4,
            "infer_micro_batch_size": 8,
            "epochs": 2,
            "learning_rate": 0.01,
            "critic_learning_rate": 0.01,
        },
        "algo": {
            "group_size": 4,
            "use_kl_in_reward": True,
            "kl_ctrl": {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.01, "horizon": 100},
        },
        "run": {
            "precision": "fp32",
            "torch_threads": 1,
            "progress": False,
            "tensorboard": False,
            "keep_checkpoints": 2,
        },
    }
    path = root / "lm.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def reference(config, tmp_path_factory) -> Path:
    """An uninterrupted run with a checkpoint every iteration, in this process (run.resume=auto
    on a run directory that does not exist yet: a fresh start)."""
    out = tmp_path_factory.mktemp("ref")
    assert (
        main(
            ["train", str(config), f"run.output_dir={out}", "run.name=ref", "run.checkpoint_every=1", "run.resume=auto"]
        )
        == 0
    )
    return out / "ref"


def _assert_same_metrics(got: list[dict], want: list[dict]) -> None:
    assert_same_metrics(got, want, ITERATIONS, TIMING)


def _same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _assert_same_final_state(a: Path, b: Path) -> None:
    for name in TRAINED_FILES:
        ta, tb = load_file(str(a / "checkpoint" / name)), load_file(str(b / "checkpoint" / name))
        assert ta.keys() == tb.keys() and ta, name
        for key in ta:
            assert torch.equal(ta[key], tb[key]), f"{name}: {key}"
    ca = checkpoint.load_checkpoint(a / "checkpoint")
    cb = checkpoint.load_checkpoint(b / "checkpoint")
    for part in ("learner", "source", "scorer", "rng"):  # optimizer, schedule, shuffle generator, ...
        _same(ca.parts[part], cb.parts[part], part)
    for key in ("iteration", "finished", "summary"):
        assert ca.meta[key] == cb.meta[key], key
    untimed = [[{k: v for k, v in row.items() if k != "time"} for row in c.meta["eval_history"]] for c in (ca, cb)]
    assert untimed[0] == untimed[1]
    assert ca.meta["finished"] and ca.meta["iteration"] == ITERATIONS


@pytest.mark.slow
def test_sigkill_twice_then_resume_matches_the_uninterrupted_run(config, reference, tmp_path, capsys):
    run_dir = tmp_path / "killed"
    args = [str(config), f"run.output_dir={tmp_path}", "run.name=killed", "run.checkpoint_every=1"]
    kills = 0
    for rows in (2, 5):  # SIGKILL as soon as the row appears: usually inside the checkpoint write
        first = rows == 2
        proc = start_and_wait(train_cmd(*args) if first else train_cmd(*args, "--resume"), run_dir, rows)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        _, err = proc.communicate(timeout=60)
        assert len(read_rows(run_dir)) >= rows, err
        latest = rundir.latest_checkpoint(run_dir)
        if latest is not None:  # whatever the writer left, the newest complete checkpoint loads
            checkpoint.load_checkpoint(latest)
        assert not list((run_dir / "checkpoints").glob(".*")), "stale temp dirs were not cleaned"
    assert kills >= 1  # (2 unless the machine stalls this process for a whole run)
    assert (run_dir / "base_model" / "ppokit_base_model.json").is_file()
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out and "sft:" not in out  # the complete warm-started model is reused
    _assert_same_metrics(read_rows(run_dir), read_rows(reference))
    _assert_same_final_state(run_dir, reference)
    # the final checkpoint and a periodic one stay loadable (export, load_policy)
    from ppokit.commands.export import export_merged
    from ppokit.lm.model.checkpoint import load_policy

    load_policy(run_dir / "checkpoint")
    periodic = sorted((run_dir / "checkpoints").iterdir())
    assert [p.name for p in periodic] == ["iter-000005", "iter-000006"]
    assert json.loads((periodic[-1] / "policy.json").read_text())["base_model"] == "../../base_model"
    load_policy(periodic[-1])
    assert (export_merged(run_dir, tmp_path / "exported") / "config.json").is_file()
    # resuming a finished run does nothing, in every form
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert main(["train", str(config), f"run.output_dir={reference.parent}", "run.name=ref", "run.resume=auto"]) == 0
    assert capsys.readouterr().out.count("had already finished") == 2
    assert len(read_rows(run_dir)) == len(read_rows(reference)) == ITERATIONS


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_resumed_run_matches(config, reference, tmp_path):
    run_dir = tmp_path / "term"
    # no periodic checkpoints: the one written on SIGTERM is all there is to resume from
    saved = sigterm_run(train_cmd(str(config), f"run.output_dir={tmp_path}", "run.name=term"), run_dir, 3)
    assert len(read_rows(run_dir)) == checkpoint.load_checkpoint(saved).meta["iteration"]
    assert not (run_dir / "checkpoint").exists()
    # `ppokit train CONFIG --resume`: the run directory of run.name
    assert main(["train", str(config), f"run.output_dir={tmp_path}", "run.name=term", "--resume"]) == 0
    _assert_same_metrics(read_rows(run_dir), read_rows(reference))
    _assert_same_final_state(run_dir, reference)


# --------------------------------------------------------------------------- in process
def test_non_finite_steps_stop_the_run_and_keep_the_last_good_checkpoint(config, tmp_path, capsys, monkeypatch):
    poison_value_loss(monkeypatch, lambda n: n > 8)  # 4 optimizer steps per iteration: NaN from the 3rd on
    argv = [
        str(config),
        f"run.output_dir={tmp_path}",
        "run.name=nan",
        "run.checkpoint_every=1",
        "train.max_bad_steps=3",
    ]
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    good = tmp_path / "nan" / "checkpoints" / "iter-000002"
    assert "training diverged: 3 optimizer steps in a row" in err and str(good) in err and "\n" not in err
    assert not (tmp_path / "nan" / "checkpoint").exists()
    assert rundir.latest_checkpoint(tmp_path / "nan") == good
    for name in TRAINED_FILES:
        assert all(torch.isfinite(t).all() for t in load_file(str(good / name)).values())
    assert [r["skipped_steps"] for r in read_rows(tmp_path / "nan")] == [0.0, 0.0]


@pytest.mark.parametrize("to_group", [False, True], ids=["sigterm", "ctrl-c"])
def test_a_signal_during_the_warm_start_stops_the_run_at_once(config, tmp_path, to_group):
    """SIGTERM during the warm start used to kill the run without a word (exit 143), and Ctrl-C
    ended the warm start early and went on to PPO with it. Now either stops the run at once, in
    one line that says how to start it again, and nothing marks the warm start as finished."""
    run_dir = tmp_path / "warm"
    args = [str(config), f"run.output_dir={tmp_path}", "run.name=warm", "data.sft_epochs=200"]
    args += ["data.prompts=arithmetic:digits=2", "data.sft_examples=64"]  # epochs long enough to signal within
    proc = subprocess.Popen(
        train_cmd(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**subprocess_env(), "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        seen = []
        for line in proc.stdout:  # at least 8 epochs to go: the warm start's patience
            seen.append(line)
            if line.startswith("sft epoch"):
                break
        assert proc.poll() is None, "".join(seen)
        if to_group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        out = "".join(seen) + proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == (130 if to_group else 143) and "Traceback" not in out, out[-3000:]
    assert out.strip().splitlines()[-1] == (
        "ppokit: interrupted while the run was set up, before its first iteration: start it again with: "
        f"ppokit train {run_dir / 'config.yaml'} run.resume=auto"
    )
    assert not (run_dir / "base_model").exists() and read_rows(run_dir) == []
    if to_group:
        return
    # the command it names starts the run over in the same directory (here with a short warm start)
    again = [str(run_dir / "config.yaml"), "run.resume=auto", "data.sft_epochs=1", "train.iterations=1"]
    assert main(["train", *again]) == 0
    assert len(read_rows(run_dir)) == 1


def test_an_incomplete_base_model_is_built_again(config, tmp_path):
    """A run killed during its warm start left a base_model without the completion marker:
    the next start deletes it and warm-starts again (the same model: SFT is seeded)."""
    from ppokit.config import load_config
    from ppokit.lm.base_model import BASE_MODEL_MARKER, prepare_model
    from ppokit.lm.inputs import load_data

    cfg = load_config(str(config))
    _, eval_items, reward_fn = load_data(cfg)
    first = prepare_model(cfg, tmp_path / "a", eval_items, reward_fn, log=None)
    assert first == tmp_path / "a" / "base_model" and (first / BASE_MODEL_MARKER).is_file()
    weights = {k: v.clone() for k, v in load_file(str(first / "model.safetensors")).items()}
    # complete: reused as it is (no warm start: the directory is not rewritten)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert prepare_model(cfg, tmp_path / "a", eval_items, reward_fn, log=None) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    # incomplete (no marker, a weight file cut short, a killed writer's temp dir): rebuilt
    (first / BASE_MODEL_MARKER).unlink()
    (first / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "a" / ".base_model.x1y2").mkdir()
    again = prepare_model(cfg, tmp_path / "a", eval_items, reward_fn, log=None)
    assert again == first and (again / BASE_MODEL_MARKER).is_file()
    assert not list((tmp_path / "a").glob(".base_model.*"))
    rebuilt = load_file(str(again / "model.safetensors"))
    assert all(torch.equal(weights[k], rebuilt[k]) for k in weights)


def test_an_lm_checkpoint_without_resume_state_is_refused(config, reference, tmp_path, capsys):
    """A checkpoint written before exact resume (no RNG state) cannot be resumed from."""
    import shutil

    run_dir = tmp_path / "old"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoint")
    shutil.rmtree(run_dir / "checkpoints" / "iter-000006")
    meta = run_dir / "checkpoints" / "iter-000005" / "meta.json"
    body = json.loads(meta.read_text())
    del body["parts"]["rng"]
    meta.write_text(json.dumps(body))
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot be resumed from: it has no rng state" in err and "\n" not in err


def test_eval_of_an_lm_run_reproduces_the_accuracy_it_printed(reference, capsys):
    """`ppokit eval RUN_DIR` scores the final actor on the run's held-out prompts, greedily:
    the same number the run printed as "held-out accuracy after PPO"."""
    meta = json.loads((reference / "checkpoint" / "meta.json").read_text())
    after = meta["summary"]["eval_accuracy_after"]
    capsys.readouterr()
    assert main(["eval", str(reference), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompts"] == 8 and result["mean_reward"] == after, result
    # a periodic checkpoint directory and a prompt limit
    periodic = sorted((reference / "checkpoints").iterdir())[-1]
    assert main(["eval", str(periodic), "--prompts", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompts"] == 4 and str(periodic) in result["model"]
