"""Loading local Hugging Face model directories (or GGUF files): the one loader for every model ppokit reads.

The policy's model, full mode's critic and reference copy, a reward model, the
supervised warm start, ``ppokit eval`` and ``ppokit export`` all load through here, so a
directory that cannot work (no such directory, no config.json, a model type transformers
does not know, a config its class refuses or with an unknown rope type, truncated or
ill-fitting weights, a model that is not causal, no tokenizer) is the same one-line
:class:`~ppokit.errors.UserError` naming the directory and the fix everywhere; nothing is
downloaded (``local_files_only``).

One rule for the special tokens of a tokenizer that generates (the policy's): it must
have an EOS token (responses end there), and one without a pad token pads with its EOS
token (the usual choice for Llama-family tokenizers, which ship none); padding is on the
left, as batched generation needs. A tokenizer that only reads (a reward model's) pads on
the right and cuts long inputs from the left, so the response is kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils import logging as hf_logging

from ppokit.errors import UserError, first_line
from ppokit.lm.model.gguf import model_directory
from ppokit.lm.model.model_path import local_model_directory

__all__ = [
    "TOKENIZER_FILES",
    "MetaModel",
    "causal_lm_config",
    "check_generation_config",
    "check_tokenizer_fits",
    "hf_config",
    "held_load_report",
    "input_embedding_rows",
    "later_tokens_influence",
    "linear_module_names",
    "load_causal_lm",
    "load_hf_model",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "meta_build",
    "meta_model",
    "quiet_transformers",
    "weights_problem",
]

# config.json sizes that transformers does not check but that no model can have below 1
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")

# generation_config.json's numbers that transformers reads when a call leaves them unset (greedy decoding)
GENERATION_NUMBERS = (
    "temperature",
    "top_p",
    "top_k",
    "typical_p",
    "min_p",
    "repetition_penalty",
    "max_length",
    "max_new_tokens",
    "min_length",
    "min_new_tokens",
    "no_repeat_ngram_size",
)

# A causal model's earlier positions see identical inputs (exactly 0 measured in fp32 and bf16); an
# encoder's change with the later tokens (0.05-0.9 for small BERTs; 0.003 at BERT's near-zero random init)
CAUSALITY_TOLERANCE = 1e-2

# Files a Hugging Face tokenizer is loaded from; a directory with none of them has no tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def load_tokenizer(path: str | Path, what: str = "model.path", *, generation: bool = True):
    """A local directory's tokenizer; UserError when there is none.

    ``generation`` (the policy's): left padding, and an EOS and a pad token are required.
    Otherwise (a reward model's): right padding, truncation from the left, no requirement.
    A GGUF file stands for its converted directory (:mod:`ppokit.lm.model.gguf`).
    """
    path = path if Path(path).is_dir() else local_model_directory(path, what)  # a GGUF file, or an error
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"{what}={path}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)}); save the "
            "model's tokenizer into the directory (tokenizer.save_pretrained)"
        )
    side = "left" if generation else "right"
    try:
        tok = AutoTokenizer.from_pretrained(str(path), padding_side=side, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"{what}={path}: no usable tokenizer there ({first_line(exc)}); save the model's "
            "tokenizer into the directory"
        ) from None
    tok.padding_side = side
    if not generation:
        tok.truncation_side = "left"  # a scored text keeps its end (the response)
        return tok
    if tok.eos_token_id is None:
        raise UserError(
            f"{what}={path}: the tokenizer has no EOS token; set eos_token in its "
            "tokenizer_config.json so that responses can end"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # the module's rule: pad with EOS (masked out anyway)
    return tok


def check_tokenizer_fits(tokenizer, rows: int | None, what: str, path: str | Path) -> None:
    """The tokenizer's ids must index the model's ``rows`` input embeddings (None: not known):
    tokens added to a tokenizer (a pad token, say) without ``resize_token_embeddings`` would
    fail inside the first forward pass; they are a UserError naming them instead."""
    size = len(tokenizer)
    if not isinstance(rows, int) or size <= rows:
        return
    beyond = tokenizer.convert_ids_to_tokens(list(range(rows, min(size, rows + 3))))
    raise UserError(
        f"{what}={path}: the tokenizer has {size} tokens but the model embeds {rows} (ids from {rows} on, "
        f"{', '.join(map(str, beyond))}{', ...' if size > rows + 3 else ''}, have no embedding); resize the "
        "model to its tokenizer (model.resize_token_embeddings(len(tokenizer)), then save_pretrained) or "
        "use the tokenizer it was trained with"
    )


def input_embedding_rows(model: nn.Module) -> int:
    """Rows of a model's input embedding: the token ids it can read."""
    return int(model.get_input_embeddings().weight.shape[0])


def causal_lm_config(path: str | Path, what: str = "model.path"):
    """The model config of a local directory, checked to be a causal LM (no weights loaded)."""
    return hf_config(
        path, what, MODEL_FOR_CAUSAL_LM_MAPPING, "is not a causal language model (AutoModelForCausalLM cannot load it)"
    )


@dataclass(frozen=True)
class MetaModel:
    """What a model's config builds (a causal LM, a reward model), read off it on the meta device (no memory)."""

    parameters: int  # tied weights once: exact for every architecture, the experts of a mixture included
    module_names: tuple[str, ...]  # every named submodule's dotted name
    linear_names: tuple[str, ...]  # the distinct last names of its linear layers (what LoRA can target)

    @classmethod
    def of(cls, model: nn.Module) -> MetaModel:
        return cls(
            parameters=sum(p.numel() for p in model.parameters()),
            module_names=tuple(name for name, _ in model.named_modules() if name),
            linear_names=tuple(linear_module_names(model)),
        )


# meta_model's answers by (auto class, config's JSON): a run's start asks for one model several times
_META_MODELS: dict[tuple[str, str], MetaModel | None] = {}


def meta_build(config, auto=AutoModelForCausalLM) -> nn.Module | None:
    """A new model of ``config`` as ``auto`` builds it (a causal LM by default), on the meta device
    (0.05-0.1 s for Mixtral-8x7B's or SmolLM2-135M's config); its :class:`MetaModel` is kept for
    :func:`meta_model`. None when transformers cannot build it from the config alone."""
    try:
        with on_the_meta_device():
            model = auto.from_config(config)
    except Exception:  # noqa: BLE001 - any failure: callers fall back on formulas, the real load says why
        model = None
    _META_MODELS[_meta_key(config, auto)] = None if model is None else MetaModel.of(model)
    return model


def meta_model(config, auto=AutoModelForCausalLM) -> MetaModel | None:
    """:class:`MetaModel` of ``config`` as ``auto`` builds it: built once per config in a process
    (:func:`meta_build`). None when transformers cannot build it from the config alone."""
    key = _meta_key(config, auto)
    if key not in _META_MODELS:
        meta_build(config, auto)
    return _META_MODELS[key]


def _meta_key(config, auto) -> tuple[str, str]:
    to_json = getattr(config, "to_json_string", None)
    return auto.__name__, to_json() if callable(to_json) else repr(config)


def linear_module_names(lm: nn.Module) -> list[str]:
    """The distinct names of a model's linear layers: what ``model.lora_target_modules`` can name."""
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in lm.named_modules()
            if name and (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D")
        }
    )


def hf_config(path: str | Path, what: str, mapping, not_loadable: str):
    """The model config of a local directory, checked to be in ``mapping`` (an auto class's
    configs; otherwise the UserError says the config ``not_loadable``). A GGUF file stands for
    its converted directory."""
    path = path if Path(path).is_dir() else local_model_directory(path, what)  # a GGUF file, or an error
    if not (Path(path) / "config.json").is_file():
        raise UserError(
            f"{what}={path}: no config.json there, so not a Hugging Face model directory (save the "
            "model with save_pretrained)"
        )
    with held_load_report():  # transformers' warnings about a config refused here are not printed
        return _checked_config(path, what, mapping, not_loadable)


def _checked_config(path: str | Path, what: str, mapping, not_loadable: str):
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        unknown = re.search(r"model type `([^`]+)`", str(exc))
        if unknown:
            raise UserError(
                f"{what}={path}: config.json has model_type '{unknown.group(1)}', which transformers "
                f"{transformers.__version__} does not know; upgrade transformers or fix config.json"
            ) from None
        raise UserError(f"{what}={path}: not a Hugging Face model directory ({first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - the config class's own validation (huggingface_hub's strict dataclasses), a bad dtype
        raise UserError(f"{what}={path}: config.json is not valid ({_last_line(exc)}); fix config.json") from None
    if type(config) not in mapping:
        raise UserError(f"{what}={path}: a {type(config).__name__} {not_loadable}")
    for field in SIZE_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise UserError(
                f"{what}={path}: config.json has {field}={value}, which must be at least 1; fix config.json"
            )
    known = ["default", *sorted(ROPE_INIT_FUNCTIONS)]
    unknown_rope = sorted(set(rope_types(config)) - set(known))
    if unknown_rope:
        raise UserError(
            f"{what}={path}: config.json's rope_type '{unknown_rope[0]}' is not one transformers "
            f"{transformers.__version__} knows ({', '.join(known)}); fix config.json"
        )
    return config


def rope_types(config) -> list[str]:
    """The ``rope_type`` values of a config's rotary settings (``rope_parameters``, or
    ``rope_scaling`` before transformers 5; one dict, or one per attention kind)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return []
    parts = [rope, *(v for v in rope.values() if isinstance(v, dict))]
    return [str(part["rope_type"]) for part in parts if "rope_type" in part]


def _last_line(exc: BaseException) -> str:
    """The last non-empty line of an error (a validation error's first line names only the validator)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def load_causal_lm(
    path: str | Path,
    what: str = "model.path",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` of a local directory; UserError on bad input.

    ``attn_implementation``: None keeps the model's default (sdpa where supported).
    Weights that are truncated, corrupt, incomplete (a tensor of the model missing: it would
    start random) or do not fit config.json, and a model that is not causal (an encoder with a
    language-model head: :func:`later_tokens_influence`), are a UserError naming the directory
    (and transformers' load report is not printed then).
    """
    config = causal_lm_config(path, what)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}

    def has_every_weight(model, info: dict) -> None:
        missing = sorted(info.get("missing_keys") or ())  # (a tied output layer is not missing)
        if missing:
            listed = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            raise UserError(
                f"{what}={path}: the weights lack {len(missing)} of the model's tensors ({listed}), which would "
                "start random; save the whole causal language model there (AutoModelForCausalLM's save_pretrained, "
                "not the bare AutoModel's)"
            )

    def is_whole_and_causal(model, info: dict) -> None:
        has_every_weight(model, info)
        check_generation_config(model, Path(path), f"{what}={path}")
        if getattr(model.config, "is_decoder", None) is not False:
            return  # decoder-only configs have no is_decoder field (transformers 5): no probe needed
        influence = later_tokens_influence(model, f"{what}={path}")
        if influence > CAUSALITY_TOLERANCE:
            raise UserError(
                f"{what}={path}: the model is not causal: its outputs at a position change with later tokens "
                f"({influence:.2g} of their own change; {type(model).__name__}: an encoder with an LM head), "
                "so generating token by token and scoring whole sequences would disagree; use a decoder-only causal "
                "language model (an encoder such as BERT is one only with is_decoder: true in its config.json)"
            )

    return load_hf_model(AutoModelForCausalLM, path, what, config, check=is_whole_and_causal, dtype=dtype, **kwargs)


def check_generation_config(model: nn.Module, path: Path, name: str) -> None:
    """UserError (naming the model as ``name``) when the directory ``path``'s generation_config.json
    is not a JSON object (transformers then silently falls back to the defaults of config.json:
    another end-of-sequence token, other sampling settings), or gives a sampling field something
    other than a number (``"top_k": "x"`` failed inside generate)."""
    file = path / "generation_config.json"
    if file.is_file():
        try:
            parsed = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(
                f"{name}: generation_config.json is not valid JSON ({first_line(exc)}); fix or remove it"
            ) from None
        if not isinstance(parsed, dict):
            raise UserError(f"{name}: generation_config.json holds a {type(parsed).__name__}, not a JSON object")
    gen = getattr(model, "generation_config", None)
    for field in GENERATION_NUMBERS:
        value = getattr(gen, field, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UserError(
                f"{name}: generation_config.json has {field}={value!r}, which is not a number; fix or remove that field"
            )


@torch.no_grad()
def later_tokens_influence(model: nn.Module, name: str) -> float:
    """How much a position's logits depend on later tokens: for two 8-token inputs that differ in
    their last 4 tokens, ``max |dlogits|`` over the first 4 positions divided by that over the last
    4. 0 for a causal language model, whose first positions see the same inputs in both. UserError
    (naming the model as ``name``) when the model cannot run on them."""
    rows = input_embedding_rows(model)
    first = torch.arange(8, device=model.device) % rows  # [8]
    second = first.clone()
    second[4:] = (first[4:] + rows // 2) % rows
    training = model.training
    model.eval()
    try:
        logits = model(input_ids=torch.stack([first, second]), use_cache=False).logits.float()  # [2, 8, V]
    except Exception as exc:  # noqa: BLE001 - any failure of the user's model code
        raise UserError(f"{name}: the model fails on a forward pass of 8 tokens ({first_line(exc)})") from None
    finally:
        model.train(training)
    change = (logits[0] - logits[1]).abs().amax(-1)  # [8]
    later = change[4:].max().item()
    return change[:4].max().item() / later if later > 0 else 0.0


def load_hf_model(
    auto_class, path: str | Path, what: str, config, *, check: Callable[[nn.Module, dict], None] | None = None, **kwargs
) -> nn.Module:
    """``auto_class.from_pretrained`` of a local directory with a config from :func:`hf_config`,
    in ``eval()`` mode; any failure is a UserError naming the directory. ``check(model,
    loading_info)`` may raise one too, before transformers' load report is printed (it is
    dropped when loading fails)."""
    path = path if Path(path).is_dir() else model_directory(path, what)
    with held_load_report() as report:
        try:
            model, info = auto_class.from_pretrained(
                str(path), config=config, local_files_only=True, output_loading_info=True, **kwargs
            )
        except ImportError as exc:
            raise UserError(
                f"model.attn_implementation={kwargs.get('attn_implementation')}: "
                f"{first_line(exc).rstrip('.')}; install the package it needs or use auto, sdpa "
                "or eager"
            ) from None
        except ValueError as exc:
            if "Unrecognized configuration class" in str(exc) or auto_class.__name__ in str(exc):
                raise UserError(f"{what}={path}: {auto_class.__name__} cannot load a {type(config).__name__}") from None
            raise UserError(f"{what}={path}: cannot load the model ({first_line(exc)})") from None
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, RuntimeError: the files are bad
            raise UserError(f"{what}={path}: {weights_problem(exc, report)}") from None
        if check is not None:
            check(model, info)
    model.eval()  # no dropout anywhere: scoring and update passes must agree exactly
    return model


@contextlib.contextmanager
def held_load_report() -> Iterator[list[str]]:
    """Hold back transformers' log messages (its weight-loading report) during the block.

    Yields the list the messages collect in; they are printed as usual when the block
    succeeds and dropped when it raises (the error then says what the report said).
    Progress bars are hidden too (:func:`ppokit.lm.model.tiny.quiet_transformers`).
    """
    messages: list[str] = []
    held: list[logging.LogRecord] = []
    logger = logging.getLogger("transformers")

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)
            messages.append(record.getMessage())

    handlers, hold = list(logger.handlers), Hold()
    for handler in handlers:
        logger.removeHandler(handler)
    logger.addHandler(hold)
    try:
        with quiet_transformers():
            yield messages
    finally:
        logger.removeHandler(hold)
        for handler in handlers:
            logger.addHandler(handler)
    for record in held:  # only reached when the block succeeded
        logger.handle(record)


# a row of transformers' load report: "NAME | MISMATCH | ... ckpt: torch.Size([..]) vs model: torch.Size([..])"
_MISMATCH = re.compile(
    r"^([^|\n]+?)\s*\|\s*MISMATCH\b.*?"
    r"ckpt: torch\.Size\((\[[^\]]*\])\) vs model: ?torch\.Size\((\[[^\]]*\])\)",
    re.MULTILINE,
)


def weights_problem(exc: BaseException, report: Sequence[str] = ()) -> str:
    """Why a model directory's weights did not load, as one clause with the fix (no path)."""
    mismatch = next((m for text in report for m in [_MISMATCH.search(text)] if m), None)
    if mismatch:
        name, saved, configured = mismatch.groups()
        return (
            f"the weights do not fit config.json ({name} is {saved} in the weights, {configured} by "
            "config.json); fix config.json or save the model again with save_pretrained"
        )
    if "size mismatch" in str(exc) or "ignore_mismatched_sizes" in str(exc):
        return "the weights do not fit config.json; fix config.json or save the model again with save_pretrained"
    if isinstance(exc, OSError) and "no file named" in str(exc):
        return (
            f"cannot load the model weights: the directory holds no weight file ({first_line(exc)}); "
            "save the model there with save_pretrained"
        )
    if isinstance(exc, SafetensorError) or "safetensors" in str(exc).lower():
        return f"the weight file is corrupt or truncated ({first_line(exc)}); copy or save the model again"
    return f"cannot load the model weights ({type(exc).__name__}: {first_line(exc)})"


def load_model_and_tokenizer(path: str | Path, what: str = "model.path") -> tuple[nn.Module, object]:
    """A causal LM (float32 master weights, eval mode) and its generation tokenizer from ``path``."""
    model, tokenizer = load_causal_lm(path, what), load_tokenizer(path, what)
    check_tokenizer_fits(tokenizer, input_embedding_rows(model), what, path)
    return model, tokenizer


@contextlib.contextmanager
def on_the_meta_device() -> Iterator[None]:
    """Models built in the block are on the meta device (shapes, no memory), without transformers'
    warnings about their configs (the model's real load gives them once)."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            yield
    finally:
        hf_logging.set_verbosity(level)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hide transformers' per-call progress bars (loading/writing shards) inside the block."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
