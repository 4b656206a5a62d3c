"""Where ``sft``, ``export`` and the tiny model write: bad places are one-line UserErrors,
found before the work, and a failed write leaves nothing half-written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from test_policy import lm_config

from ppokit.commands.export import export_merged
from ppokit.commands.sft import sft_main
from ppokit.errors import UserError
from ppokit.lm import sft
from ppokit.lm.data.tasks import ArithmeticTask
from ppokit.lm.model.checkpoint import save_policy
from ppokit.lm.model.hf import load_tokenizer
from ppokit.lm.model.policy import build_policy
from ppokit.lm.model.tiny import build_tiny_model


@pytest.fixture
def mount(tmp_path):
    """``mount(options)``: an empty tmpfs (``ro``, ``size=64k``, ...) at a new directory; skips
    where tmpfs cannot be mounted (not root)."""
    mounted = []

    def make(options: str):
        path = tmp_path / f"mnt{len(mounted)}"
        path.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
        except FileNotFoundError:
            pytest.skip("no mount command")
        if done.returncode:
            pytest.skip("needs permission to mount a tmpfs")
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True)


@pytest.fixture
def checkpoint(tiny_dir, tmp_path):
    """An untrained lora checkpoint (what a run saves), made without training."""
    policy = build_policy(lm_config(tiny_dir), tiny_dir, device=torch.device("cpu"), autocast_dtype=None)
    return save_policy(
        policy, tmp_path / "run" / "checkpoint", base_model=str(tiny_dir), tokenizer=load_tokenizer(tiny_dir)
    )


@pytest.fixture
def no_training(monkeypatch):
    """SFT that fails the test if it starts training: output checks must come first."""

    def train(*args, **kwargs):
        raise AssertionError("trained before checking the output directory")

    monkeypatch.setattr(sft, "_train", train)


def run_sft(model_dir, out, **options):
    examples = ArithmeticTask(digits=1, seed=0).items("sft", 4)
    settings = sft.SFTSettings(epochs_max=1, batch_size=4, precision="fp32")
    return sft.run_sft(model_dir, out, examples, examples, settings, log=None, **options)


def test_sft_output_that_is_a_file_or_not_empty(tiny_dir, tmp_path, no_training):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(UserError, match="afile is a file, not a directory; choose a new or empty output directory"):
        run_sft(tiny_dir, afile)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(UserError) as info:
        run_sft(tiny_dir, full)
    assert str(info.value).endswith("full is not empty; choose a new or empty output directory")
    assert (full / "keep.txt").read_text() == "mine"


def test_export_output_that_is_a_file_or_not_empty(checkpoint, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(UserError, match="afile is a file, not a directory; choose a new directory for the export"):
        export_merged(checkpoint.parent, afile)
    with pytest.raises(UserError, match="checkpoint is not empty"):
        export_merged(checkpoint.parent, checkpoint)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs a /proc file system")
def test_a_directory_that_takes_no_new_entries_fails_before_the_work(tiny_dir, checkpoint, no_training):
    """procfs answers a new directory with ENOENT, not a permission error."""
    with pytest.raises(UserError, match="cannot write /proc/exp: /proc takes no new directories; choose a new dir"):
        export_merged(checkpoint.parent, Path("/proc/exp"))
    with pytest.raises(UserError, match="cannot write /proc/s: /proc takes no new directories"):
        run_sft(tiny_dir, Path("/proc/s"))


def test_read_only_output_fails_before_the_work(tiny_dir, checkpoint, mount, no_training):
    ro = mount("ro,size=64k")
    with pytest.raises(UserError, match=f"cannot write {ro}/s: Read-only file system; choose a writable location"):
        run_sft(tiny_dir, ro / "s")
    with pytest.raises(UserError, match=f"cannot write {ro}/exp/sub: Read-only file system"):
        export_merged(checkpoint.parent, ro / "exp" / "sub")


def test_full_disk_leaves_nothing_half_written(tiny_dir, checkpoint, mount):
    full = mount("size=64k")  # room for the tokenizer, not for the weights
    with pytest.raises(UserError, match=f"cannot write {full}/exp: No space left on device"):
        export_merged(checkpoint.parent, full / "exp")
    with pytest.raises(UserError, match=f"cannot write {full}/tiny: No space left on device"):
        build_tiny_model(full / "tiny", hidden_size=64, num_layers=2, num_heads=2)
    with pytest.raises(UserError, match=f"cannot write {full}/sft: No space left on device"):
        run_sft(tiny_dir, full / "sft")
    assert list(full.iterdir()) == []


def test_a_mount_point_as_output_fails_before_the_work(tiny_dir, checkpoint, mount, no_training):
    for options in ("ro,size=64k", "size=64k"):
        point = mount(options)
        for make in (lambda: run_sft(tiny_dir, point), lambda: export_merged(checkpoint, point)):
            with pytest.raises(
                UserError, match="is a mount point, which the output cannot replace; give a new directory inside it"
            ):
                make()
        assert list(point.iterdir()) == []


def test_sft_counts_that_must_be_positive_name_their_flag(tmp_path):
    for options, flag in (({"examples": 0}, "--examples"), ({"eval_size": 0}, "--eval-size")):
        with pytest.raises(UserError, match=f"^sft {flag} must be a positive integer \\(got 0\\)$"):
            sft_main("arithmetic", tmp_path / "s", log=None, **options)
