"""``run.device`` naming a device this machine lacks: one line naming the choices, before any model loads."""

from __future__ import annotations

import pytest
import torch

from ppokit.cli import main


@pytest.mark.parametrize("device", ["mps", "cuda", "cuda:7"])
def test_an_unavailable_device_is_a_one_line_error_naming_the_choices(tiny_dir, tmp_path, capsys, monkeypatch, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if getattr(torch.backends, "mps", None) is not None:
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    args = [
        "train",
        "arith",
        f"model.path={tiny_dir}",
        "data.sft_epochs=0",
        "data.eval_size=0",
        "train.iterations=1",
        "train.batch_size=8",
        "train.mini_batch_size=8",
        "train.micro_batch_size=8",
        "algo.group_size=4",
        "rollout.max_new_tokens=2",
        f"run.device={device}",
        "run.tensorboard=false",
        "--output-dir",
        str(tmp_path),
        "--name",
        "r",
        "--no-progress",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert f"run.device={device}: no such device on this machine; available: auto, cpu" in err and "\n" not in err
    # nothing was started or built: the corrected command may use the directory it left
    monkeypatch.undo()
    assert (tmp_path / "r" / "config.yaml").is_file()
    assert (
        main(
            args[:-7]
            + ["run.device=cpu", "run.tensorboard=false", "--output-dir", str(tmp_path), "--name", "r", "--no-progress"]
        )
        == 0
    )


def test_available_devices_lists_what_torch_reports(monkeypatch):
    from ppokit.lm.model.device import available_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert available_devices()[:5] == ["auto", "cpu", "cuda", "cuda:0", "cuda:1"]
