"""Export a trained LM policy as a plain Hugging Face model directory.

:func:`export_merged` merges the ``actor`` LoRA adapter of ``RUN_DIR/checkpoint`` into
its backbone (``W + (alpha / r) B A``) and writes a directory that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load with
no peft installed. In full mode the checkpoint's actor already is such a model; it is
re-saved with the tokenizer. The critic and the value head are not part of the export
(they stay in the checkpoint).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ppokit.commands.arguments import add_command

if TYPE_CHECKING:
    from ppokit.persistence.rundir import RunDir


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "export",
        run,
        help="merge a trained LM's actor into a standalone model directory",
        description="Write the trained actor (LoRA merged into the backbone) and the "
        "tokenizer to OUT, loadable by AutoModelForCausalLM.from_pretrained.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("out_dir", metavar="OUT")


def run(args: argparse.Namespace) -> int:
    print(f"exported to {export_merged(args.run_dir, args.out_dir)}")
    return 0


def export_merged(run_dir: str | Path | RunDir, out_dir: str | Path) -> Path:
    """Write the actor of ``run_dir``'s final checkpoint (:meth:`ppokit.persistence.rundir.RunDir.export_checkpoint`;
    or of the checkpoint directory ``run_dir``) as a standalone model (+ tokenizer) to ``out_dir``
    (new or empty)."""
    from ppokit.output_paths import check_output_dir, writing_to
    from ppokit.persistence.checkpoint_files import atomic_directory
    from ppokit.persistence.rundir import RunDir

    ckpt = (run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)).export_checkpoint()
    out = Path(out_dir)
    check_output_dir(out, "choose a new directory for the export")
    # the model's modules (transformers) once the paths are known good: bad input answers at once
    from ppokit.lm.model.checkpoint import base_model_of, load_adapter, read_policy_meta
    from ppokit.lm.model.hf import load_causal_lm, load_tokenizer, quiet_transformers
    from ppokit.lm.model.policy import ACTOR

    meta = read_policy_meta(ckpt)
    tokenizer = load_tokenizer(ckpt, "the checkpoint's tokenizer")
    if meta["mode"] == "lora":
        base = load_causal_lm(base_model_of(ckpt, meta), "the checkpoint's base model")
        model = load_adapter(base, ckpt, ACTOR).merge_and_unload()
    else:
        model = load_causal_lm(ckpt / ACTOR, "the checkpoint's actor")
    # a full disk: a UserError, and no half-written export
    with writing_to(out), atomic_directory(out) as tmp, quiet_transformers():
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
    return out
