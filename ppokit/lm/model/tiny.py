"""A tiny Llama-style causal LM and a character tokenizer, built here, saved in HF format.

This is the embedded default policy of the language-model workload: nothing is
downloaded. :func:`build_tiny_model` writes a directory that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load
like any hub checkpoint (``model.safetensors``, ``config.json``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``), plus
``ppokit_tiny.json``, the spec it was built from, so that a second call with the same
spec reuses the directory instead of building again.

The tokenizer has one token per character of its alphabet and four special tokens
(``<pad>`` 0, ``<unk>`` 1, ``<bos>`` 2, ``<eos>`` 3). Encoding prepends ``<bos>``;
decoding concatenates characters (no spaces are inserted). Padding is on the left,
set when the tokenizer is built (and saved with it), as batched generation needs.

Sizes (vocabulary 56): the default spec (hidden 128, 4 layers, 4 heads, MLP 344) has
806,016 parameters (about 0.8 M) and learns 2-digit addition in minutes on two CPU
cores.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ppokit.errors import UserError
from ppokit.lm.model.hf import quiet_transformers
from ppokit.output_paths import writing_to

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")
PAD, UNK, BOS, EOS = SPECIAL_TOKENS
# Digits and arithmetic first (the built-in tasks), then enough punctuation and lower-case
# letters for small text prompts. Characters outside the alphabet encode as <unk>.
DEFAULT_ALPHABET = "0123456789+-*/=()., :;?!'\n" + "abcdefghijklmnopqrstuvwxyz"
SPEC_FILE = "ppokit_tiny.json"
SPEC_FORMAT = 1


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines a tiny model: same spec, same weights."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int | None = None  # None: 8/3 * hidden, rounded up to a multiple of 8
    max_position_embeddings: int = 64
    seed: int = 0
    alphabet: str = DEFAULT_ALPHABET

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"tiny model: {name} must be a positive integer (got {getattr(self, name)!r})")
        if self.hidden_size % self.num_heads:
            raise UserError(
                f"tiny model: hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise UserError(
                f"tiny model: hidden_size / num_heads = {self.hidden_size // self.num_heads} "
                "must be even (rotary embeddings)"
            )
        if self.intermediate_size is not None and (
            not isinstance(self.intermediate_size, int) or self.intermediate_size < 1
        ):
            raise UserError(
                f"tiny model: intermediate_size must be a positive integer or null (got {self.intermediate_size!r})"
            )
        _check_alphabet(self.alphabet)

    @property
    def mlp_size(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        third = -(-8 * self.hidden_size // 3)  # ceil(8/3 * hidden), the Llama ratio
        return -(-third // 8) * 8  # rounded up to a multiple of 8

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.alphabet)

    def num_parameters(self) -> int:
        """Parameter count of the model this spec builds (untied embeddings)."""
        h, f, v, n = self.hidden_size, self.mlp_size, self.vocab_size, self.num_layers
        per_layer = 4 * h * h + 3 * h * f + 2 * h  # q, k, v, o; gate, up, down; two RMSNorms
        return 2 * v * h + n * per_layer + h  # embeddings + lm_head, layers, final norm

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_alphabet(alphabet: str) -> None:
    if not isinstance(alphabet, str) or not alphabet:
        raise UserError("tiny model: the alphabet must be a non-empty string of characters")
    seen = set()
    dupes = sorted({c for c in alphabet if c in seen or seen.add(c)})
    if dupes:
        raise UserError(
            f"tiny model: the alphabet repeats {', '.join(repr(c) for c in dupes)}; list each character once"
        )


DEFAULT_TINY_SPEC = TinySpec()


# ------------------------------------------------------------------------- tokenizer
def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, padding_side: str = "left"):
    """A ``PreTrainedTokenizerFast`` with one token per character of ``alphabet``.

    Ids: ``<pad>`` 0, ``<unk>`` 1, ``<bos>`` 2, ``<eos>`` 3, then the alphabet in order.
    ``tok("37+48=")`` gives ``<bos>`` and one id per character; ``tok.decode(ids,
    skip_special_tokens=True)`` gives the characters back, concatenated.
    ``padding_side`` is set at construction (setting it afterwards is easy to forget on
    a reloaded copy; here it is saved in ``tokenizer_config.json``).
    """
    _check_alphabet(alphabet)
    if padding_side not in ("left", "right"):
        raise UserError(f"padding_side must be 'left' or 'right' (got {padding_side!r})")
    vocab = {token: i for i, token in enumerate(list(SPECIAL_TOKENS) + list(alphabet))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char a word
    core.decoder = decoders.Fuse()  # join without spaces
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        padding_side=padding_side,
        model_max_length=1_000_000,
    )


# ----------------------------------------------------------------------------- model
def tiny_config(spec: TinySpec):
    """The ``LlamaConfig`` of ``spec``, with the tokenizer's special-token ids."""
    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.mlp_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        tie_word_embeddings=False,
        initializer_range=0.02,
    )


def build_tiny_model(
    out_dir: str | os.PathLike,
    *,
    hidden_size: int = DEFAULT_TINY_SPEC.hidden_size,
    num_layers: int = DEFAULT_TINY_SPEC.num_layers,
    num_heads: int = DEFAULT_TINY_SPEC.num_heads,
    intermediate_size: int | None = DEFAULT_TINY_SPEC.intermediate_size,
    max_position_embeddings: int = DEFAULT_TINY_SPEC.max_position_embeddings,
    seed: int = DEFAULT_TINY_SPEC.seed,
    alphabet: str = DEFAULT_ALPHABET,
) -> Path:
    """Build (or reuse) a randomly initialised tiny model + tokenizer in ``out_dir``.

    Idempotent: when ``out_dir`` already holds a model built from the same spec it is
    returned as is. A directory holding anything else is never overwritten (UserError).
    The directory appears atomically (built in a sibling temporary directory, renamed).
    """
    spec = TinySpec(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
        alphabet=alphabet,
    )
    return build_tiny_model_from_spec(out_dir, spec)


def build_tiny_model_from_spec(out_dir: str | os.PathLike, spec: TinySpec = DEFAULT_TINY_SPEC) -> Path:
    """:func:`build_tiny_model` taking a :class:`TinySpec`."""
    out = Path(out_dir)
    recorded = read_tiny_spec(out)
    if recorded is not None:
        if recorded == spec:
            return out
        changed = [f.name for f in fields(TinySpec) if getattr(recorded, f.name) != getattr(spec, f.name)]
        raise UserError(
            f"{out} holds a tiny model built with a different spec ({', '.join(changed)} "
            f"{'differs' if len(changed) == 1 else 'differ'}); "
            "choose another directory or delete it"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not a ppokit tiny model; choose an empty or new directory")

    with writing_to(out):  # a read-only or full file system: a UserError, nothing left behind
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            tokenizer = build_char_tokenizer(spec.alphabet, padding_side="left")
            config = tiny_config(spec)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(spec.seed)
                model = LlamaForCausalLM(config)
            model.generation_config = GenerationConfig(
                bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
            )
            with quiet_transformers():
                model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            _portable_tokenizer_config(tmp)
            record = {"format": SPEC_FORMAT, "spec": spec.to_dict(), "num_parameters": model.num_parameters()}
            (tmp / SPEC_FILE).write_text(json.dumps(record, indent=2) + "\n")
            if out.exists():
                out.rmdir()  # empty (checked above)
            os.replace(tmp, out)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError) and read_tiny_spec(out) == spec:  # another process built it meanwhile
                return out
            raise
    return out


def read_tiny_spec(model_dir: str | os.PathLike) -> TinySpec | None:
    """The :class:`TinySpec` recorded in ``model_dir``, or None if it is not a tiny model."""
    path = Path(model_dir) / SPEC_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        return TinySpec(**record["spec"])
    except (ValueError, KeyError, TypeError, UserError):
        return None


def _portable_tokenizer_config(model_dir: Path) -> None:
    """Name the generic fast tokenizer class, which transformers 4.x and 5.x both load."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
