"""Checkpoints: safetensors + JSON round trips, atomic writes, one-line errors on damage."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ppokit.errors import UserError
from ppokit.persistence import checkpoint, checkpoint_files


def _state():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    gen = torch.Generator().manual_seed(3)
    return (
        model,
        opt,
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "gen": gen.get_state(),
            "misc": {
                "np": np.arange(6.0).reshape(2, 3),
                "np0": np.array(2.5),
                "t0": torch.tensor(3),
                "tuple": (1, 2.5),
                "none": None,
                "flag": True,
                "name": "x",
                7: "int key",
                "inf": float("inf"),
            },
        },
    )


def test_round_trip_restores_every_kind_of_value(tmp_path):
    model, opt, state = _state()
    checkpoint.save_checkpoint(tmp_path / "ck", {"a": state}, {"iteration": 3})
    ck = checkpoint.load_checkpoint(tmp_path / "ck")
    assert ck.meta["iteration"] == 3 and ck.meta["format"] == checkpoint.FORMAT
    back = ck.parts["a"]
    for k, v in state["model"].items():
        assert torch.equal(back["model"][k], v)
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(back["opt"])
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt2.state[p][key], opt.state[p][key])
    assert opt2.param_groups[0]["betas"] == list(opt.param_groups[0]["betas"])
    assert torch.equal(back["gen"], state["gen"])
    assert isinstance(back["misc"]["np"], np.ndarray) and np.array_equal(back["misc"]["np"], state["misc"]["np"])
    assert back["misc"]["tuple"] == [1, 2.5] and back["misc"]["none"] is None and back["misc"]["flag"] is True
    assert back["misc"]["np0"].shape == () and back["misc"]["np0"] == 2.5 and back["misc"]["t0"].shape == ()
    assert back["misc"][7] == "int key" and back["misc"]["inf"] == float("inf")
    # nothing pickled: every file is JSON or safetensors
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["a.safetensors", "meta.json"]


def test_unsupported_objects_are_refused(tmp_path):
    with pytest.raises(TypeError, match="no pickling"):
        checkpoint.save_checkpoint(tmp_path / "ck", {"a": {"f": object()}}, {})
    assert not (tmp_path / "ck").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # the temp dir is gone


def test_overwrite_is_atomic_and_a_failed_write_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    checkpoint.save_checkpoint(path, {"a": {"x": torch.zeros(2)}}, {"n": 1})
    checkpoint.save_checkpoint(path, {"a": {"x": torch.ones(2)}}, {"n": 2})
    assert checkpoint.load_checkpoint(path).meta["n"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", boom)
    with pytest.raises(OSError):
        checkpoint.save_checkpoint(path, {"a": {"x": torch.full((2,), 5.0)}}, {"n": 3})
    ck = checkpoint.load_checkpoint(path)
    assert ck.meta["n"] == 2 and torch.equal(ck.parts["a"]["x"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def _saved(tmp_path):
    path = tmp_path / "ck"
    checkpoint.save_checkpoint(path, {"model": {"w": torch.randn(64, 64)}}, {"n": 1})
    return path


@pytest.mark.parametrize(
    "damage, file",
    [
        (
            lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:100]),
            "model.safetensors",
        ),
        (lambda p: (p / "model.safetensors").write_bytes(b"\x00garbage" * 10), "model.safetensors"),
        (lambda p: (p / "model.safetensors").unlink(), "model.safetensors"),
        (lambda p: (p / "meta.json").write_text('{"format": "ppokit-checkpoint", "par'), "meta.json"),
        (lambda p: (p / "meta.json").write_text(json.dumps({"hello": 1})), "meta.json"),
        (lambda p: (p / "meta.json").unlink(), "meta.json"),
    ],
)
def test_damaged_checkpoints_raise_one_line_user_errors_naming_the_file(tmp_path, damage, file):
    path = _saved(tmp_path)
    damage(path)
    with pytest.raises(UserError) as info:
        checkpoint.load_checkpoint(path)
    message = str(info.value)
    assert str(path / file) in message and "\n" not in message


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        checkpoint.load_checkpoint(tmp_path / "nope")


def test_prune_keeps_the_newest(tmp_path):
    from ppokit.persistence import rundir

    for i in range(5):
        checkpoint.save_checkpoint(rundir.periodic_checkpoint_path(tmp_path, i), {"a": {"x": torch.zeros(1)}}, {})
    rundir.prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in (tmp_path / rundir.PERIODIC_DIR).iterdir()) == ["iter-000003", "iter-000004"]


def test_a_live_writers_temporary_directories_are_left_alone(tmp_path):
    """`ppokit eval RUN_DIR` while the run is training must not delete the checkpoint it is writing."""
    import os

    from resume_helpers import dead_pid

    live, dead = os.getpid(), dead_pid()
    checkpoint.save_checkpoint(tmp_path / "iter-000001", {"a": {"x": torch.zeros(1)}}, {"iteration": 1})
    (tmp_path / f".iter-000002.tmp-{live}").mkdir()  # being written
    (tmp_path / "iter-000001").rename(tmp_path / f".iter-000001.old-{live}")  # being replaced
    (tmp_path / f".iter-000003.tmp-{dead}").mkdir()  # a killed writer's
    checkpoint_files.recover_interrupted(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".iter-000001.old-{live}", f".iter-000002.tmp-{live}"]
    assert checkpoint_files.pid_alive(live) and not checkpoint_files.pid_alive(dead)
