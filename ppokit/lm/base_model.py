"""The backbone a language-model run trains: ``model.path``, the built-in tiny model, or a warm-started copy.

:func:`prepare_model` returns the directory the policy is built on. With the tiny model,
a GGUF file or a warm start (``data.sft_epochs`` > 0) that is ``RUN_DIR/base_model``: the
tiny model's random init, the GGUF file's converted directory (:mod:`ppokit.lm.model.gguf`),
or the best model of the supervised warm start (:func:`ppokit.lm.sft.run_sft`). Its marker
:data:`BASE_MODEL_MARKER` is written last, so a resumed run reuses a complete one and never
warm-starts again.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ppokit.config import Config
from ppokit.errors import UserError
from ppokit.lm.data.chat import render_records
from ppokit.lm.data.records import count_tokens_with
from ppokit.lm.inputs import chat_render, load_sft_records
from ppokit.lm.model.device import run_device
from ppokit.lm.model.gguf import converted_directory, is_gguf
from ppokit.lm.model.tiny import DEFAULT_TINY_SPEC, build_char_tokenizer, build_tiny_model
from ppokit.lm.sft import SFTSettings, run_sft
from ppokit.monitoring.peak_memory import release_freed_memory

BASE_MODEL_DIR = "base_model"
BASE_MODEL_MARKER = "ppokit_base_model.json"  # in base_model/, written when it is complete
INIT_MODEL_DIR = "init_model"


def progress(text: str) -> None:
    """A progress line before the run's tracker (and its progress bar) exists."""
    print(text, flush=True)


def prepare_model(
    cfg: Config,
    run_dir: Path,
    eval_items: list[dict],
    reward_fn,
    log,
    prompts: list[dict] | None = None,
    sft_examples: list[dict] | None = None,
) -> Path:
    """The backbone's directory: model.path, the built-in tiny model, and/or a warm-started copy.

    The warm start trains on ``sft_examples`` (prompt/completion records, rendered with
    the chat template here when ``data.chat_template`` is on) or, by default, the SFT
    split of ``data.prompts``.

    A complete ``RUN_DIR/base_model`` (its :data:`BASE_MODEL_MARKER` is written last) is
    reused as it is: a resumed run does not warm-start again. An incomplete one (a run
    killed while building it) is deleted and built again, deterministically.
    """
    path = cfg.model.path
    base = run_dir / BASE_MODEL_DIR
    gguf = path != "tiny" and is_gguf(path)  # the built-in model is never a GGUF file
    if path == "tiny" or cfg.data.sft_epochs or gguf:
        if (base / BASE_MODEL_MARKER).is_file():
            return base
        for leftover in [base, *run_dir.glob(f".{BASE_MODEL_DIR}.*"), *run_dir.glob(f".{INIT_MODEL_DIR}.*")]:
            if leftover.is_dir():  # a killed build or warm start: start it over
                shutil.rmtree(leftover)
    if gguf:  # converted once into the cache; the run keeps its own copy (module docstring)
        path = str(converted_directory(path, log=log))
        if not cfg.data.sft_epochs:
            copy_directory(Path(path), base)
            path = str(base)
    if path == "tiny":
        target = run_dir / (INIT_MODEL_DIR if cfg.data.sft_epochs else BASE_MODEL_DIR)
        path = str(build_tiny_model(target, seed=cfg.seed, max_position_embeddings=tiny_positions(cfg, prompts or [])))
    if cfg.data.sft_epochs:
        if not eval_items:
            raise UserError(
                "data.sft_epochs > 0 needs held-out prompts to pick the best warm-start model "
                "(a built-in task, or data.eval_prompts)"
            )
        examples = sft_examples if sft_examples is not None else load_sft_records(cfg)
        render = chat_render(cfg)
        if render is not None:
            examples = render_records(examples, render)
        settings = SFTSettings.for_run(cfg, device=str(run_device(cfg)))
        run_sft(path, run_dir / BASE_MODEL_DIR, examples, eval_items, settings, reward_fn=reward_fn, log=log)
        release_freed_memory()  # the full fine-tuning's freed gigabytes would stay resident through PPO
        path = str(run_dir / BASE_MODEL_DIR)
    if path == str(base):
        marker = {"model.path": cfg.model.path, "data.sft_epochs": cfg.data.sft_epochs, "seed": cfg.seed}
        (base / BASE_MODEL_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return Path(path)


def copy_directory(source: Path, target: Path) -> None:
    """``source``'s files into a new ``target``, hard-linked where the file system allows (the
    cache's files are never written again), copied otherwise."""
    target.mkdir(parents=True)
    for file in source.iterdir():
        if file.is_file():
            try:
                os.link(file, target / file.name)
            except OSError:
                shutil.copy2(file, target / file.name)


def tiny_positions(cfg: Config, prompts: list[dict]) -> int:
    """Positions of the built-in tiny model: ``model.tiny_max_positions``, else 64, or the longest
    prompt plus ``rollout.max_new_tokens`` rounded up to a multiple of 64 when that is more (rotary
    positions: the weights are the same whatever the count)."""
    if cfg.model.tiny_max_positions is not None:
        return cfg.model.tiny_max_positions
    texts = [p["prompt"] for p in prompts if isinstance(p.get("prompt"), str)]
    longest = max(count_tokens_with(build_char_tokenizer())(texts), default=0) if texts else 0
    need = longest + cfg.rollout.max_new_tokens
    base = DEFAULT_TINY_SPEC.max_position_embeddings
    return base if need <= base else -(-need // 64) * 64
