"""A trained actor or a model directory, ready to generate: what ``ppokit generate``, ``chat`` and ``eval`` load.

:func:`load_generator` takes a run directory (its final checkpoint, else its newest:
:attr:`ppokit.persistence.rundir.RunDir.lm_checkpoint`), a
checkpoint directory, a plain Hugging Face model directory or a GGUF file, and returns a
:class:`Generator`: a rollout engine (:func:`~ppokit.lm.generation.factory.make_engine`, the seam of
:mod:`ppokit.lm.generation.base`) over the trained actor (lora: the ``actor`` adapter applied to the backbone; full: the
actor model) with its tokenizer, plus the run's config when there is one. Sampling
options (temperature, top_p, top_k, max_new_tokens) start from the run's
``rollout`` section (the defaults for a model directory) and are overridden by the
caller's (:func:`ppokit.config.rollout_options`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppokit.config import rollout_options
from ppokit.errors import UserError
from ppokit.lm.generation.factory import make_engine, make_model_engine
from ppokit.lm.model.device import resolve_device, resolve_precision
from ppokit.lm.model.hf import causal_lm_config, load_model_and_tokenizer
from ppokit.lm.model.model_path import open_model_path
from ppokit.lm.model.stack import load_policy_stack
from ppokit.persistence.rundir import RunDir


@dataclass
class Generator:
    """What generates: ``engine`` (a :class:`~ppokit.lm.generation.base.RolloutEngine`), ``tokenizer``,
    the run's ``cfg`` (None for a model directory), ``label`` (what was loaded, for messages)."""

    engine: Any
    tokenizer: Any
    cfg: Any
    label: str

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))


def load_generator(
    path: str | Path | RunDir, *, device: str | None = None, precision: str | None = None, **sampling: Any
) -> Generator:
    """The generator of ``path``: a run or checkpoint directory (or its :class:`~ppokit.persistence.rundir.RunDir`,
    already read), a model directory or a GGUF file (:func:`~ppokit.lm.model.model_path.open_model_path`).
    ``device``/``precision``: as ``run.device``/``run.precision`` (default: the run's, else auto).
    ``sampling``: temperature, top_p, top_k, max_new_tokens (None keeps the run's)."""
    run = path if isinstance(path, RunDir) else open_model_path(path)
    path = run.path
    ckpt = run.lm_checkpoint
    if ckpt is not None:
        cfg = run.config(ckpt)
        rollout = rollout_options(cfg.rollout, **sampling)
        stack = load_policy_stack(ckpt, cfg, device=device, precision=precision)
        engine = make_engine(stack.policy, stack.tokenizer, rollout, kv_cache=stack.kv_cache)
        return Generator(engine, stack.tokenizer, cfg, f"the trained actor of {ckpt}")
    if (run.saved or {}).get("workload") == "control":
        raise UserError(f"{path} is a control run: generate and chat sample from a language model's run or directory")
    if not (path / "config.json").is_file():
        raise UserError(
            f"{path} is neither a run directory with a language-model checkpoint nor a model "
            "directory (no config.json); give RUN_DIR (after ppokit train) or a Hugging Face model "
            "directory"
        )
    rollout = rollout_options(None, **sampling)
    causal_lm_config(path, "the model directory")
    dev = resolve_device(device or "auto")
    dtype = resolve_precision(precision or "auto", dev)
    model, tokenizer = load_model_and_tokenizer(path, "the model directory")
    model.to(dev).requires_grad_(False)
    engine = make_model_engine(model, tokenizer, rollout, autocast_dtype=dtype)
    return Generator(engine, tokenizer, None, str(path))
