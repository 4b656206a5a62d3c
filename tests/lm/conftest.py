"""Fixtures shared by the language-model tests (also used by the PPO workload's tests)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

# Small enough that a test can train it for a few seconds on two CPU cores; the default
# spec (ppokit.lm.model.tiny.DEFAULT_TINY_SPEC, ~0.8 M parameters) is for the demo.
TEST_TINY_SPEC = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 64, "seed": 0}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A randomly initialised tiny Llama + character tokenizer in Hugging Face format.

    Built once per test session (~100 k parameters, ``TEST_TINY_SPEC``); loadable with
    ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` (left
    padding, ``<pad>`` 0, ``<bos>`` 2, ``<eos>`` 3). Treat it as read-only: copy it or
    save elsewhere before changing weights.
    """
    from ppokit.lm.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("lm") / "tiny", **TEST_TINY_SPEC)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir) -> Path:
    """Alias of :func:`tiny_model_dir` used by the PPO workload's tests."""
    return tiny_model_dir


@pytest.fixture(scope="session")
def chat_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with :data:`lm_helpers.CHAT_TEMPLATE`, saved and reloaded the Hugging Face way."""
    from lm_helpers import CHAT_TEMPLATE

    from ppokit.lm.model.hf import load_tokenizer

    out = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_model_dir, out)
    tok = load_tokenizer(out)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: extra threads only add contention with whatever else runs on the machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
