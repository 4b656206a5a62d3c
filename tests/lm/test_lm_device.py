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
    # refused by the checks before the start (the memory check resolves the device): no run
    # directory was made, and the corrected command takes the same name
    monkeypatch.undo()
    assert not (tmp_path / "r").exists()
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


def test_one_thread_rule_for_every_process_that_builds_a_model():
    """device.threads_for is the one owner of "a small model on a CPU runs on one thread"."""
    from ppokit.errors import UserError
    from ppokit.lm.model.device import SMALL_MODEL_PARAMS, precision_name, resolve_precision, threads_for

    small, large = torch.nn.Linear(10, 10), torch.nn.Linear(1, SMALL_MODEL_PARAMS)
    cpu = torch.device("cpu")
    assert threads_for(small, cpu) == 1
    assert threads_for(large, cpu) is None  # torch's own count
    assert threads_for(small, cpu, requested=3) == 3 and threads_for(large, cpu, requested=2) == 2
    assert threads_for(small, torch.device("meta")) is None  # not a CPU: nothing to set
    assert resolve_precision("fp32", cpu) is None and precision_name(resolve_precision("bf16", cpu)) == "bf16"
    with pytest.raises(UserError, match="precision must be one of auto, bf16, fp32"):
        resolve_precision("fp16", cpu)


def test_bf16_on_a_cpu_without_native_bf16_warns_once_with_the_measured_cost(monkeypatch, caplog):
    from ppokit.lm.model import device as dev

    monkeypatch.setattr(dev, "bf16_supported", lambda d: False)
    monkeypatch.setattr(dev, "bf16_matmul_slowdown", lambda: 31.6)
    dev.warn_emulated_bf16.cache_clear()
    cpu = torch.device("cpu")
    with caplog.at_level("WARNING", logger=dev.__name__):
        assert dev.resolve_precision("bf16", cpu) == torch.bfloat16  # as asked: slow, not wrong
        assert dev.resolve_precision("bf16", cpu) == torch.bfloat16
        assert dev.resolve_precision("auto", cpu) is None
    (line,) = [r.getMessage() for r in caplog.records]  # once per process
    assert "run.precision=bf16 on a CPU without native bf16" in line and "takes 32x as long as float32" in line
    assert "run.precision=auto (fp32 on this CPU) is faster" in line and "\n" not in line
    dev.warn_emulated_bf16.cache_clear()


def test_bf16_where_it_is_native_says_nothing(monkeypatch, caplog):
    from ppokit.lm.model import device as dev

    monkeypatch.setattr(dev, "bf16_supported", lambda d: True)
    dev.warn_emulated_bf16.cache_clear()
    with caplog.at_level("WARNING", logger=dev.__name__):
        assert dev.resolve_precision("bf16", torch.device("cpu")) == torch.bfloat16
        assert dev.resolve_precision("auto", torch.device("cpu")) == torch.bfloat16
    assert not caplog.records


def test_the_bf16_slowdown_is_a_measured_ratio():
    from ppokit.lm.model.device import bf16_matmul_slowdown

    ratio = bf16_matmul_slowdown(size=64)
    assert 0 < ratio < float("inf")  # no claim on its size: machines differ
