"""A trained actor or a model directory, ready to generate: what ``ppokit generate``, ``chat`` and ``eval`` load.

:func:`load_generator` takes a run directory (its final checkpoint, else its newest), a
checkpoint directory, or a plain Hugging Face model directory, and returns a
:class:`Generator`: a rollout engine (:func:`~ppokit.lm.generation.factory.make_engine`, the seam of
:mod:`ppokit.lm.generation.base`) over the trained actor (lora: the ``actor`` adapter applied to the backbone; full: the
actor model) with its tokenizer, plus the run's config when there is one. Sampling
options (temperature, top_p, top_k, max_new_tokens) start from the run's
``rollout`` section (the defaults for a model directory) and are overridden by the
caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppokit.errors import UserError


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


def rollout_options(base, **overrides: Any):
    """A :class:`~ppokit.config.RolloutConfig` from ``base`` with the ``overrides`` that are not
    None, validated (a bad value is a one-line :class:`UserError` naming the option)."""
    from pydantic import ValidationError

    from ppokit.config import RolloutConfig, format_validation_error

    values = base.model_dump() if base is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return RolloutConfig(**values)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc).replace("rollout.", "")) from None


def load_generator(
    path: str | Path, *, device: str | None = None, precision: str | None = None, **sampling: Any
) -> Generator:
    """The generator of ``path``: a run or checkpoint directory, or a model directory (module docstring).
    ``device``/``precision``: as ``run.device``/``run.precision`` (default: the run's, else auto).
    ``sampling``: temperature, top_p, top_k, max_new_tokens (None keeps the run's)."""
    import torch

    from ppokit.lm.evaluate import _config_of, find_lm_checkpoint
    from ppokit.lm.generation.factory import make_engine, make_model_engine
    from ppokit.lm.model.device import one_thread_if_small, resolve_device, resolve_precision
    from ppokit.lm.model.hf import causal_lm_config, load_causal_lm, load_tokenizer

    path = Path(path)
    if not path.is_dir():
        raise UserError(
            f"{path} is not a directory; give a run directory (ppokit train's) or a Hugging Face model directory"
        )
    ckpt = find_lm_checkpoint(path)
    if ckpt is not None:
        from ppokit.lm.model.checkpoint import load_policy

        cfg = _config_of(ckpt)
        dev = resolve_device(device or cfg.run.device)
        dtype = resolve_precision(precision or cfg.run.precision, dev)
        tokenizer = load_tokenizer(ckpt, "the checkpoint's tokenizer")
        policy = load_policy(ckpt, device=dev, autocast_dtype=dtype)
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        kv_cache = None
        if cfg.model.cpu_kernels:  # the run's CPU kernels, as in training (a no-op off the CPU)
            from ppokit.lm.accel import accelerate_policy

            kv_cache = accelerate_policy(policy).kv_cache
        one_thread_if_small(cfg, policy, dev)
        engine = make_engine(policy, tokenizer, rollout_options(cfg.rollout, **sampling), kv_cache=kv_cache)
        return Generator(engine, tokenizer, cfg, f"the trained actor of {ckpt}")
    if not (path / "config.json").is_file():
        raise UserError(
            f"{path} is neither a run directory with a language-model checkpoint nor a model "
            "directory (no config.json); give RUN_DIR (after ppokit train) or a Hugging Face model "
            "directory"
        )
    causal_lm_config(path, "the model directory")
    dev = resolve_device(device or "auto")
    dtype = resolve_precision(precision or "auto", dev)
    tokenizer = load_tokenizer(path, "the model directory")
    model = load_causal_lm(path, "the model directory").to(dev).eval()
    model.requires_grad_(False)
    engine = make_model_engine(model, tokenizer, rollout_options(None, **sampling), autocast_dtype=dtype)
    return Generator(engine, tokenizer, None, str(path))
