"""The language-model policy with a value function: actor, critic and reference.

Two modes (``model.mode``):

``lora`` (default, the seed-000 design)
    One frozen Hugging Face causal LM carries two LoRA adapters, ``actor`` and
    ``critic`` (peft). The critic is the backbone with the ``critic`` adapter plus a
    value head (``Linear(hidden, 1)``) on its last hidden state. The reference policy
    is the backbone with the adapters disabled. Actor, critic and reference cost one
    backbone in memory.

``full``
    Full fine-tuning: the actor is a whole model, the critic a separate model
    (initialised from ``model.critic_path`` or the policy path) with a value head, and
    a frozen reference copy is loaded only when a KL term needs one.

The critic-free estimators (GRPO, RLOO, REINFORCE++: ``algo.adv_estimator`` other than
``gae``) build no critic in either mode: no ``critic`` adapter or critic model, no value
head, no optimizer state for them (in full mode a whole model and its Adam moments),
and checkpoints hold the actor alone (``policy.json``: ``"critic": false``).

For a batch laid out as ``[left-padded prompt (P) | right-padded response (R)]``
(see :mod:`ppokit.lm.rollout`), response token ``j`` sits at position ``P + j`` and
is predicted from the hidden state at ``P + j - 1``; the value of the state before
token ``j`` is read at the same position. Only those ``R`` hidden states go through
``lm_head``, so the logits are (n, R, V), never (n, P + R, V), and the log-probs are
``gather - logsumexp`` chunk by chunk (:func:`ppokit.algo.log_probs_from_logits`)
on logits divided by the sampling temperature.

The peft pitfall: ``set_adapter`` and ``disable_adapter`` reset ``requires_grad``
(only the active adapter keeps it, and disabling clears it for all). An autograd
leaf whose ``requires_grad`` is cleared between forward and backward silently gets
no gradient, and the actor pass runs before the critic pass swaps adapters. So every
swap goes through :meth:`LMPolicy.use`, which re-enables ``requires_grad`` on the
LoRA weights of both adapters after each swap; the tests check that both adapters
and the value head get gradients from one backward.

Dropout is never active (the models stay in ``eval()`` mode): the log-probs of the
scoring pass and of the first update pass are then the same computation, which is
what makes the first importance ratio exactly 1.

Precision: with bf16 autocast the frozen weights (lora backbone, full-mode reference)
are stored in bf16 (:meth:`LMPolicy.cast_frozen_weights`), on a CPU the wide ones
column-major (:mod:`ppokit.lm.weight_layout`); trained weights stay fp32.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from ppokit import algo
from ppokit.errors import UserError
from ppokit.lm.fused_lora import enable_lora_kernels, fuse_lora_layers
from ppokit.lm.weight_layout import transpose_wide_weights

ACTOR, CRITIC = "actor", "critic"
VALUE_HEAD_FILE = "value_head.safetensors"
POLICY_META_FILE = "policy.json"
# Files a Hugging Face tokenizer is loaded from; a directory with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


# ----------------------------------------------------------------------------- loading
def load_tokenizer(path: str | Path, what: str = "model.path", *, generation: bool = True):
    """A local directory's tokenizer; UserError when there is none.

    ``generation`` (the policy's): left padding, and an EOS and a pad token are required.
    Otherwise (a reward model's): right padding, truncation from the left, no requirement.
    """
    from transformers import AutoTokenizer

    _check_local_dir(path, what)
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"{what}={path}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)}); save the "
                        "model's tokenizer into the directory (tokenizer.save_pretrained)")
    side = "left" if generation else "right"
    try:
        tok = AutoTokenizer.from_pretrained(str(path), padding_side=side, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{what}={path}: no usable tokenizer there ({_first_line(exc)}); save the model's "
                        "tokenizer into the directory") from None
    tok.padding_side = side
    if not generation:
        tok.truncation_side = "left"          # a scored text keeps its end (the response)
        return tok
    if tok.eos_token_id is None:
        raise UserError(f"{what}={path}: the tokenizer has no EOS token; set eos_token in its "
                        "tokenizer_config.json so that responses can end")
    if tok.pad_token_id is None:
        raise UserError(f"{what}={path}: the tokenizer has no pad token; set pad_token in its "
                        "tokenizer_config.json (the EOS token is a common choice)")
    return tok


def causal_lm_config(path: str | Path, what: str = "model.path"):
    """The model config of a local directory, checked to be a causal LM (no weights loaded)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return hf_config(path, what, MODEL_FOR_CAUSAL_LM_MAPPING,
                     "is not a causal language model (AutoModelForCausalLM cannot load it)")


def hf_config(path: str | Path, what: str, mapping, not_loadable: str):
    """The model config of a local directory, checked to be in ``mapping`` (an auto class's
    configs; otherwise the UserError says the config ``not_loadable``)."""
    from transformers import AutoConfig

    _check_local_dir(path, what)
    if not (Path(path) / "config.json").is_file():
        raise UserError(f"{what}={path}: no config.json there, so not a Hugging Face model directory (save the "
                        "model with save_pretrained)")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        unknown = re.search(r"model type `([^`]+)`", str(exc))
        if unknown:
            import transformers

            raise UserError(f"{what}={path}: config.json has model_type '{unknown.group(1)}', which transformers "
                            f"{transformers.__version__} does not know; upgrade transformers or fix config.json") \
                from None
        raise UserError(f"{what}={path}: not a Hugging Face model directory ({_first_line(exc)})") from None
    if type(config) not in mapping:
        raise UserError(f"{what}={path}: a {type(config).__name__} {not_loadable}")
    return config


def load_causal_lm(path: str | Path, what: str = "model.path", dtype: torch.dtype = torch.float32,
                   attn_implementation: Optional[str] = None) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` of a local directory; UserError on bad input.

    ``attn_implementation``: None keeps the model's default (sdpa where supported).
    Weights that are truncated, corrupt or do not fit config.json are a UserError naming
    the directory (and transformers' load report is not printed then).
    """
    from transformers import AutoModelForCausalLM

    config = causal_lm_config(path, what)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return load_hf_model(AutoModelForCausalLM, path, what, config, dtype=dtype, **kwargs)


def load_hf_model(auto_class, path: str | Path, what: str, config, *,
                  check: Optional[Callable[[nn.Module, dict], None]] = None, **kwargs) -> nn.Module:
    """``auto_class.from_pretrained`` of a local directory with a config from :func:`hf_config`,
    in ``eval()`` mode; any failure is a UserError naming the directory. ``check(model,
    loading_info)`` may raise one too, before transformers' load report is printed (it is
    dropped when loading fails)."""
    with held_load_report() as report:
        try:
            model, info = auto_class.from_pretrained(str(path), config=config, local_files_only=True,
                                                     output_loading_info=True, **kwargs)
        except ImportError as exc:
            raise UserError(f"model.attn_implementation={kwargs.get('attn_implementation')}: "
                            f"{_first_line(exc).rstrip('.')}; install the package it needs or use auto, sdpa "
                            "or eager") from None
        except ValueError as exc:
            if "Unrecognized configuration class" in str(exc) or auto_class.__name__ in str(exc):
                raise UserError(f"{what}={path}: {auto_class.__name__} cannot load a "
                                f"{type(config).__name__}") from None
            raise UserError(f"{what}={path}: cannot load the model ({_first_line(exc)})") from None
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, RuntimeError: the files are bad
            raise UserError(f"{what}={path}: {weights_problem(exc, report)}") from None
        if check is not None:
            check(model, info)
    model.eval()   # no dropout anywhere: scoring and update passes must agree exactly
    return model


@contextlib.contextmanager
def held_load_report() -> Iterator[list[str]]:
    """Hold back transformers' log messages (its weight-loading report) during the block.

    Yields the list the messages collect in; they are printed as usual when the block
    succeeds and dropped when it raises (the error then says what the report said).
    Progress bars are hidden too (:func:`ppokit.lm.tiny.quiet_transformers`).
    """
    import logging

    from ppokit.lm.tiny import quiet_transformers

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
    for record in held:          # only reached when the block succeeded
        logger.handle(record)


# a row of transformers' load report: "NAME | MISMATCH | ... ckpt: torch.Size([..]) vs model: torch.Size([..])"
_MISMATCH = re.compile(r"^([^|\n]+?)\s*\|\s*MISMATCH\b.*?"
                       r"ckpt: torch\.Size\((\[[^\]]*\])\) vs model: ?torch\.Size\((\[[^\]]*\])\)", re.MULTILINE)


def weights_problem(exc: BaseException, report: Sequence[str] = ()) -> str:
    """Why a model directory's weights did not load, as one clause with the fix (no path)."""
    from safetensors import SafetensorError

    mismatch = next((m for text in report for m in [_MISMATCH.search(text)] if m), None)
    if mismatch:
        name, saved, configured = mismatch.groups()
        return (f"the weights do not fit config.json ({name} is {saved} in the weights, {configured} by "
                "config.json); fix config.json or save the model again with save_pretrained")
    if "size mismatch" in str(exc) or "ignore_mismatched_sizes" in str(exc):
        return "the weights do not fit config.json; fix config.json or save the model again with save_pretrained"
    if isinstance(exc, OSError) and "no file named" in str(exc):
        return (f"cannot load the model weights: the directory holds no weight file ({_first_line(exc)}); "
                "save the model there with save_pretrained")
    if isinstance(exc, SafetensorError) or "safetensors" in str(exc).lower():
        return (f"the weight file is corrupt or truncated ({_first_line(exc)}); copy or save the model "
                "again")
    return f"cannot load the model weights ({type(exc).__name__}: {_first_line(exc)})"


def _check_local_dir(path: str | Path, what: str) -> None:
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{what}={path}: no such model directory (give a local Hugging Face model "
                        "directory; ppokit does not download models)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


# ----------------------------------------------------------------------------- precision
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"run.device={name} but no CUDA device is available; use run.device=cpu")
    return torch.device(name)


def bf16_supported(device: torch.device) -> bool:
    """True where bf16 matmuls run natively (CUDA with bf16, CPU with AVX512-BF16/AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            try:
                flags = Path("/proc/cpuinfo").read_text()
            except OSError:
                return False
            return "avx512_bf16" in flags or "amx_bf16" in flags
    return False


def resolve_precision(name: str, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype: ``torch.bfloat16`` or None (fp32). ``auto`` = bf16 where supported."""
    if name == "fp32":
        return None
    if name == "bf16":
        if device.type == "cpu" or bf16_supported(device):
            return torch.bfloat16
        raise UserError(f"run.precision=bf16 is not supported on {device}; use fp32 or auto")
    return torch.bfloat16 if bf16_supported(device) else None


# ----------------------------------------------------------------------------- the policy
class ValueHead(nn.Module):
    """``V(s) = w . h + b`` on the critic's last hidden state, always in float32 (zero-initialised)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        # V = 0 at the start: a random head would predict values of order 1 while
        # rewards may be small, and its large first gradients would dominate the
        # global gradient-norm clip that the actor shares.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:   # (n, R, H) -> (n, R)
        with torch.autocast(hidden.device.type, enabled=False):
            return self.linear(hidden.float()).squeeze(-1)


class LMPolicy(nn.Module):
    """Actor, critic (value head) and reference over one or more causal LMs.

    Implements the trainer's policy protocol (:meth:`param_groups`, :meth:`evaluate`)
    plus the passes rollouts and scoring need: :meth:`log_probs`, :meth:`values`,
    :meth:`ref_log_probs`, and :meth:`use` to put the actor adapter in place for
    generation. Inputs of every pass (``micro_batch`` keys)::

        input_ids       (n, P + R)  left-padded prompt, then the response
        attention_mask  (n, P + R)  1 on real tokens (prompt and response up to EOS)
        position_ids    (n, P + R)  cumsum(attention_mask) - 1, clamped at 0
        responses       (n, R)      the response tokens (pad after EOS)
    """

    def __init__(self, lm: nn.Module, value_head: Optional[ValueHead], *, mode: str, temperature: float = 1.0,
                 autocast_dtype: Optional[torch.dtype] = None, critic_lm: Optional[nn.Module] = None,
                 ref_lm: Optional[nn.Module] = None, compute_entropy: bool = True):
        super().__init__()
        if mode not in ("lora", "full"):
            raise ValueError(f"mode must be 'lora' or 'full', got {mode!r}")
        self.mode = mode
        self.lm = lm                      # lora: a PeftModel with adapters actor (+ critic)
        self.value_head = value_head      # None: no critic (critic-free estimators)
        self.critic_lm = critic_lm        # full mode with a critic only
        self.ref_lm = ref_lm              # full mode only, frozen, None unless a KL term needs it
        self.temperature = float(temperature)
        self.autocast_dtype = autocast_dtype
        self.compute_entropy = compute_entropy
        self.trainable = True             # False: adapters stay frozen across swaps (inference)
        self._active: Optional[str] = None
        self._adapter_params: dict[str, list[nn.Parameter]] = {}
        self.fused_kernel_counts: dict[str, int] = {}   # filled by fuse_cpu_kernels
        if mode == "full" and (critic_lm is None) != (value_head is None):
            raise ValueError("full mode takes a critic model and a value head together, or neither")
        if mode == "lora":
            for name in self.adapter_names:
                params = [p for n, p in lm.named_parameters() if "lora_" in n and f".{name}." in n]
                if not params:
                    raise ValueError(f"the peft model has no LoRA weights for adapter '{name}'")
                self._adapter_params[name] = params
            ids = {id(p) for ps in self._adapter_params.values() for p in ps}
            for p in lm.parameters():
                if id(p) not in ids:
                    p.requires_grad_(False)          # the backbone is frozen
            fuse_lora_layers(lm)                     # matmul-only LoRA forward/backward
            with self.use(ACTOR):                    # the actor active, both adapters trainable
                pass
        else:
            if ref_lm is not None:
                ref_lm.requires_grad_(False)
        self._direct_head = {id(m): _hidden_then_head_matches(m) for m in self._lms()}

    # ------------------------------------------------------------------ structure
    def _lms(self) -> list[nn.Module]:
        return [m for m in (self.lm, self.critic_lm, self.ref_lm) if m is not None]

    @property
    def has_critic(self) -> bool:
        """Whether there is a critic (adapter or model, and value head). The critic-free
        estimators (GRPO, RLOO, REINFORCE++) build none: no memory, no optimizer state."""
        return self.value_head is not None

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """lora: the trained adapters, ``("actor", "critic")`` or ``("actor",)``."""
        return (ACTOR, CRITIC) if self.has_critic else (ACTOR,)

    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device

    @property
    def actor_model(self) -> nn.Module:
        """The Hugging Face model that generates (lora: call inside ``use('actor')``)."""
        return self.lm

    @property
    def has_reference(self) -> bool:
        return self.mode == "lora" or self.ref_lm is not None

    def adapter_parameters(self, name: str) -> list[nn.Parameter]:
        return self._adapter_params[name]

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        """Make ``actor`` / ``critic`` the active adapter (lora); restore grads after the swap.

        peft's ``set_adapter`` clears ``requires_grad`` on the inactive adapter, which
        would silently drop the gradient of a pass already recorded with it.
        """
        if self.mode == "lora" and self._active != name:
            self.lm.set_adapter(name)
            self._active = name
            self._restore_requires_grad()
        yield

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """lora: adapters disabled (the backbone); full: nothing (pass ``ref_lm``)."""
        if self.mode == "lora":
            try:
                with self.lm.disable_adapter():
                    yield
            finally:
                self._restore_requires_grad()   # disabling cleared it on every adapter
        else:
            if self.ref_lm is None:
                raise RuntimeError("no reference model loaded (full mode loads one only when a KL term needs it)")
            yield

    def freeze(self) -> "LMPolicy":
        """Inference only: no parameter requires grad, and swaps do not re-enable them."""
        self.trainable = False
        self.requires_grad_(False)
        return self

    def _restore_requires_grad(self) -> None:
        if not self.trainable:
            for params in self._adapter_params.values():
                for p in params:
                    p.requires_grad_(False)
            return
        for params in self._adapter_params.values():
            for p in params:
                p.requires_grad_(True)

    def cast_frozen_weights(self, dtype: Optional[torch.dtype]) -> int:
        """Store frozen parameters (the lora backbone, the full-mode reference) in ``dtype``.

        Under bf16 autocast every matmul casts an fp32 weight to bf16 on each call (the
        autocast cache only keeps casts of trainable leaves): a frozen weight gains
        nothing from fp32 storage. Stored in bf16 it costs half the memory, no copies,
        and the residual stream between frozen layers is bf16 too, so the inputs of the
        next matmuls need no cast either (as with FSDP's bf16 ``param_dtype``). Trained
        weights (LoRA, value head, full-mode actor and critic) stay fp32 master weights;
        buffers (rotary frequencies) stay fp32. On a CPU, frozen bf16 weights with more
        outputs than inputs are then stored column-major, which oneDNN's bf16 matmul runs
        1.3-1.5x faster (:mod:`ppokit.lm.weight_layout`). Returns the number of tensors cast.
        """
        if dtype is None:
            return 0
        count = 0
        for lm in self._lms():
            for name, p in lm.named_parameters():
                if not p.requires_grad and "lora_" not in name and p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
                    count += 1
            for module in lm.modules():
                # peft casts a LoRA layer's (now bf16) input up to the adapter's fp32 weight
                # dtype, and autocast casts it straight back: two copies per layer for
                # nothing. Every pass runs under autocast, which handles the dtypes.
                if hasattr(module, "cast_input_dtype_enabled"):
                    module.cast_input_dtype_enabled = False
            if dtype == torch.bfloat16:
                # oneDNN's bf16 matmul wants wide weights column-major (ppokit.lm.weight_layout).
                transpose_wide_weights(lm, dtype)
        return count

    def fuse_cpu_kernels(self) -> dict[str, int]:
        """On a CPU, give the models' RMSNorm, SwiGLU and rotary layers ppokit's fused
        kernels (:mod:`ppokit.lm.kernels`; bf16 and fp32), and in LoRA mode in bf16 on a CPU
        with AMX or AVX512-BF16 the LoRA layers' rank-r products (``lora_amx`` or
        ``lora_avx512``); returns how many of each kind.
        On other devices nothing changes and the counts are empty."""
        from ppokit.lm.kernels.fuse import fuse_cpu_kernels

        counts: dict[str, int] = {}
        if self.device.type != "cpu":
            return counts
        for lm in self._lms():
            for kind, n in fuse_cpu_kernels(lm).items():
                counts[kind] = counts.get(kind, 0) + n
        if self.mode == "lora" and self.autocast_dtype == torch.bfloat16:
            from ppokit.lm.kernels.functions import lora_kernels_kind

            layers = enable_lora_kernels(self.lm)     # LoRA's rank-r products on AMX or AVX512-BF16
            if layers:
                counts[f"lora_{lora_kernels_kind()}"] = layers
        self.fused_kernel_counts = counts
        return counts

    def autocast(self):
        dtype = self.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None)

    # ------------------------------------------------------------------ the passes
    def _hidden(self, lm: nn.Module, mb: dict[str, Tensor]) -> Tensor:
        """Hidden states that predict the response tokens (n, R, H)."""
        input_ids, responses = mb["input_ids"], mb["responses"]
        R = responses.shape[1]
        start = input_ids.shape[1] - R - 1                       # position P - 1
        kwargs = dict(input_ids=input_ids, attention_mask=mb["attention_mask"],
                      position_ids=mb["position_ids"], use_cache=False)
        if self._direct_head[id(lm)]:
            hidden = _decoder(lm)(**kwargs).last_hidden_state     # (n, P + R, H)
        else:
            hidden = lm(**kwargs, output_hidden_states=True).hidden_states[-1]
        return hidden[:, start:start + R]

    def _token_log_probs(self, lm: nn.Module, mb: dict[str, Tensor], entropy: bool) -> dict[str, Tensor]:
        responses = mb["responses"]
        with self.autocast():
            if self._direct_head[id(lm)]:
                hidden = self._hidden(lm, mb)                                 # (n, R, H)
                head = lm.get_output_embeddings()
                if getattr(head, "bias", None) is None and self.temperature != 1.0:
                    logits = head(hidden / self.temperature)                  # (n, R, V): W(h/T) = (Wh)/T
                else:
                    logits = head(hidden)
                    if self.temperature != 1.0:
                        logits = logits.div_(self.temperature)
            else:   # a model whose logits are not lm_head(last hidden state): full logits, sliced
                R = responses.shape[1]
                start = mb["input_ids"].shape[1] - R - 1
                logits = lm(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                            position_ids=mb["position_ids"], use_cache=False).logits[:, start:start + R]
                logits = logits / self.temperature
            out = {"log_prob": algo.log_probs_from_logits(logits, responses)}   # (n, R) float32
            if entropy:
                out["entropy"] = algo.entropy_from_logits(logits)
        return out

    def log_probs(self, mb: dict[str, Tensor], entropy: bool = False) -> dict[str, Tensor]:
        """Actor log-probs (and entropy) of the response tokens, (n, R) float32."""
        with self.use(ACTOR):
            return self._token_log_probs(self.lm, mb, entropy)

    def ref_log_probs(self, mb: dict[str, Tensor]) -> Tensor:
        """Reference log-probs (n, R): the backbone without adapters, or the frozen copy."""
        with torch.no_grad(), self.reference():
            lm = self.lm if self.mode == "lora" else self.ref_lm
            return self._token_log_probs(lm, mb, entropy=False)["log_prob"]

    def values(self, mb: dict[str, Tensor]) -> Tensor:
        """Token-level values (n, R) float32 from the critic pass (zeros without a critic)."""
        if not self.has_critic:
            return torch.zeros(mb["responses"].shape, dtype=torch.float32, device=mb["responses"].device)
        lm = self.lm if self.mode == "lora" else self.critic_lm
        with self.use(CRITIC), self.autocast():
            hidden = self._hidden(lm, mb)                                     # (n, R, H)
        return self.value_head(hidden)

    # ------------------------------------------------------------------ trainer protocol
    def evaluate(self, micro_batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``log_prob``, ``values`` (with a critic) and ``entropy``, each (n, R) float32."""
        out = self.log_probs(micro_batch, entropy=self.compute_entropy)
        if self.has_critic:
            out["values"] = self.values(micro_batch)
        return out

    def param_groups(self, cfg) -> list[dict[str, Any]]:
        t = cfg.train
        critic_lr = t.critic_learning_rate or t.learning_rate
        if self.mode == "lora":
            actor = list(self._adapter_params[ACTOR])
        else:
            actor = [p for p in self.lm.parameters() if p.requires_grad]
        groups = [{"params": actor, "lr": t.learning_rate, "name": "actor"}]
        if self.has_critic:
            if self.mode == "lora":
                critic = list(self._adapter_params[CRITIC])
            else:
                critic = [p for p in _decoder(self.critic_lm).parameters() if p.requires_grad]
            critic += list(self.value_head.parameters())
            groups.append({"params": critic, "lr": critic_lr, "name": "critic"})
        return groups

    # ------------------------------------------------------------------ saving
    def save(self, out_dir: str | Path, *, base_model: str, tokenizer=None) -> Path:
        """Adapters (peft format, ``actor/`` and ``critic/``) or full models, plus the value head
        (the actor alone without a critic; ``policy.json`` says which).

        ``base_model`` is the directory the backbone came from (recorded in
        ``policy.json`` so that the checkpoint can be reloaded and exported).
        """
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.mode == "lora":
            # peft writes an adapter not named "default" into a sub-folder of its name:
            # out/actor/adapter_model.safetensors, out/critic/...
            self.lm.save_pretrained(str(out), selected_adapters=list(self.adapter_names),
                                    save_embedding_layers=False)
        else:
            self.lm.save_pretrained(str(out / ACTOR))
            if self.has_critic:
                self.critic_lm.save_pretrained(str(out / CRITIC))
        if self.has_critic:
            save_file({k: v.detach().float().contiguous().cpu() for k, v in self.value_head.state_dict().items()},
                      str(out / VALUE_HEAD_FILE))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
        meta = {"mode": self.mode, "base_model": _portable_path(Path(base_model), out),
                "temperature": self.temperature, "critic": self.has_critic}
        if self.has_critic:
            meta["hidden_size"] = self.value_head.linear.in_features
        (out / POLICY_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return out

    def load_trained_state(self, ckpt_dir: str | Path) -> None:
        """Load the trained weights of a checkpoint written by :meth:`save` into this policy.

        For exact resume: the policy is built as for a fresh run (same construction, so
        the optimizer sees the parameters in the same order), then the adapters or full
        models and the value head are copied in. A file that is missing, damaged or does
        not fit is a :class:`UserError` naming it.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        ckpt = Path(ckpt_dir)
        meta = read_policy_meta(ckpt)
        if meta["mode"] != self.mode:
            raise UserError(f"checkpoint {ckpt} holds a {meta['mode']} policy, this run trains a {self.mode} one")
        if self.has_critic and not meta["critic"]:
            raise UserError(f"checkpoint {ckpt} has no critic (it was trained with a critic-free "
                            "algo.adv_estimator), but this run trains one (gae); resume it with its own estimator")

        def read(file: Path) -> dict[str, Tensor]:
            if not file.is_file():
                raise UserError(f"checkpoint file {file} is missing")
            try:
                return load_file(str(file))
            except (SafetensorError, OSError) as exc:
                raise UserError(f"checkpoint file {file} is corrupt or truncated ({_first_line(exc)})") from None

        try:
            with torch.no_grad():
                if self.mode == "lora":
                    from peft import set_peft_model_state_dict

                    for name in self.adapter_names:     # a checkpoint's unused critic is left out
                        file = ckpt / name / "adapter_model.safetensors"
                        state = read(file)
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            result = set_peft_model_state_dict(self.lm, state, adapter_name=name)
                        loaded = len(state) - len(getattr(result, "unexpected_keys", []) or [])
                        if getattr(result, "unexpected_keys", None) or loaded != len(self._adapter_params[name]):
                            raise UserError(f"checkpoint file {file} does not fit this model's {name} adapter "
                                            f"({loaded} of {len(self._adapter_params[name])} LoRA tensors)")
                else:
                    for name, lm in ((ACTOR, self.lm), (CRITIC, self.critic_lm)):
                        if lm is not None:
                            _load_hf_weights(lm, ckpt / name, read)
                if self.has_critic:
                    self.value_head.load_state_dict(read(ckpt / VALUE_HEAD_FILE))
        except (RuntimeError, KeyError, ValueError) as exc:
            raise UserError(f"checkpoint {ckpt} does not fit this run's model ({_first_line(exc)})") from None
        # the adapter swaps of a fresh policy: actor active, every trained weight requires grad
        self._active = None
        with self.use(ACTOR):
            pass


def _load_hf_weights(model: nn.Module, folder: Path, read) -> None:
    """Copy a ``save_pretrained`` directory's safetensors weights into ``model`` (same architecture)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UserError(f"checkpoint file {index} is corrupt or truncated") from None
    else:
        files = ["model.safetensors"]
    state: dict[str, Tensor] = {}
    for name in files:
        state.update(read(folder / name))
    own = model.state_dict()
    unknown = [k for k in state if k not in own]
    if unknown:
        raise UserError(f"checkpoint {folder} does not fit this run's model (unexpected weight {unknown[0]})")
    tied = {k for k in own if k not in state and any(own[k] is own[o] or own[k].data_ptr() == own[o].data_ptr()
                                                       for o in state if o in own)}
    missing = [k for k in own if k not in state and k not in tied and "rotary_emb" not in k]
    if missing:
        raise UserError(f"checkpoint {folder} does not fit this run's model (no weight {missing[0]})")
    model.load_state_dict(state, strict=False)


def _portable_path(target: Path, ckpt: Path) -> str:
    """``target`` relative to the checkpoint when both live in one run directory, else absolute.

    The run directory of ``RUN_DIR/checkpoint`` is its parent, that of a periodic
    ``RUN_DIR/checkpoints/iter-NNNNNN`` (or of its temporary sibling) its grandparent.
    """
    target, ckpt = target.resolve(), ckpt.resolve()
    roots = [ckpt.parent] + ([ckpt.parent.parent] if ckpt.parent.name == "checkpoints" else [])
    if any(root in target.parents for root in roots):
        return os.path.relpath(target, ckpt)
    return str(target)


def _load_value_head(ckpt: Path, hidden_size: int) -> ValueHead:
    """The checkpoint's value head; a missing, damaged or ill-fitting file is a UserError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    head = ValueHead(hidden_size)
    head_file = ckpt / VALUE_HEAD_FILE
    if not head_file.is_file():
        raise UserError(f"checkpoint file {head_file} is missing")
    try:
        head.load_state_dict(load_file(str(head_file)))
    except (SafetensorError, OSError) as exc:
        raise UserError(f"checkpoint file {head_file} is corrupt or truncated ({_first_line(exc)})") from None
    except (RuntimeError, KeyError) as exc:
        raise UserError(f"checkpoint file {head_file} does not fit hidden_size={hidden_size} "
                        f"({_first_line(exc)})") from None
    return head


def read_policy_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    """``policy.json`` of a checkpoint, checked; a missing or damaged file is a UserError naming it."""
    ckpt = Path(ckpt_dir)
    path = ckpt / POLICY_META_FILE
    if not path.is_file():
        raise UserError(f"{ckpt} is not a ppokit LM checkpoint (no {POLICY_META_FILE})")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"checkpoint file {path} is corrupt or truncated ({type(exc).__name__})") from None
    if not isinstance(meta, dict):
        raise UserError(f"checkpoint file {path} is corrupt: expected a JSON object")
    if meta.get("mode") not in ("lora", "full"):
        raise UserError(f"checkpoint file {path} is corrupt: mode is {meta.get('mode')!r}, expected 'lora' or 'full'")
    if meta["mode"] == "lora" and not isinstance(meta.get("base_model"), str):
        raise UserError(f"checkpoint file {path} is corrupt: a lora checkpoint needs base_model (the backbone "
                        "directory)")
    meta.setdefault("critic", True)          # checkpoints before critic-free policies always had one
    if not isinstance(meta["critic"], bool):
        raise UserError(f"checkpoint file {path} is corrupt: critic is {meta['critic']!r}, expected true or false")
    if meta["critic"] and (isinstance(meta.get("hidden_size"), bool) or not isinstance(meta.get("hidden_size"), int)):
        raise UserError(f"checkpoint file {path} is corrupt: hidden_size is {meta.get('hidden_size')!r}")
    return meta


def load_adapter(lm: nn.Module, ckpt_dir: str | Path, name: str, *, trainable: bool = False) -> nn.Module:
    """Put the peft adapter ``ckpt_dir/name`` on ``lm`` (a base model, or a PeftModel for a second
    adapter); a missing or damaged adapter file is a UserError naming it."""
    from peft import PeftModel
    from safetensors import SafetensorError

    folder = Path(ckpt_dir) / name
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        if not (folder / file).is_file():
            raise UserError(f"checkpoint file {folder / file} is missing")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if isinstance(lm, PeftModel):
                lm.load_adapter(str(folder), adapter_name=name, is_trainable=trainable)
                return lm
            return PeftModel.from_pretrained(lm, str(folder), adapter_name=name, is_trainable=trainable)
    except SafetensorError as exc:
        raise UserError(f"checkpoint file {folder / 'adapter_model.safetensors'} is corrupt or truncated "
                        f"({_first_line(exc)})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"checkpoint file {folder / 'adapter_config.json'} is corrupt or truncated "
                        f"({type(exc).__name__})") from None
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise UserError(f"checkpoint {folder}: cannot load the {name} adapter onto the base model "
                        f"({_first_line(exc)})") from None


def base_model_of(ckpt_dir: str | Path) -> Path:
    """The backbone directory a checkpoint was trained from (lora mode)."""
    ckpt = Path(ckpt_dir)
    meta = read_policy_meta(ckpt)
    path = Path(meta["base_model"])
    return path if path.is_absolute() else (ckpt / path).resolve()


def _decoder(lm: nn.Module) -> nn.Module:
    """The transformer body of a causal LM (the peft wrapper is looked through)."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    return base.get_decoder()


def _hidden_then_head_matches(lm: nn.Module) -> bool:
    """Whether ``lm_head(decoder(x).last_hidden_state)`` equals ``lm(x).logits``.

    True for Llama/Qwen/Mistral/GPT-2-like models; False for models that post-process
    logits (soft-capping, logit scales), which then take the full-logits path.
    """
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    try:
        decoder, head = base.get_decoder(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError, ValueError):
        return False
    if decoder is None or head is None or decoder is base:
        return False
    device = next(base.parameters()).device
    ids = torch.arange(1, 5, device=device)[None] % max(2, base.config.vocab_size)
    with torch.no_grad():
        try:
            full = base(input_ids=ids, use_cache=False).logits
            split = head(decoder(input_ids=ids, use_cache=False).last_hidden_state)
        except Exception:   # noqa: BLE001 - any failure means "use the general path"
            return False
    return full.shape == split.shape and torch.allclose(full, split, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- building
def lora_config(model_cfg):
    from peft import LoraConfig

    return LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, lora_dropout=0.0,
                      target_modules=model_cfg.lora_target_modules, bias="none", task_type="CAUSAL_LM")


def build_policy(cfg, model_path: str | Path, *, device: torch.device, autocast_dtype: Optional[torch.dtype],
                 need_reference: Optional[bool] = None, need_critic: Optional[bool] = None,
                 seed: Optional[int] = None) -> LMPolicy:
    """The configured policy around the model at ``model_path`` (fresh adapters / value head).

    ``need_reference`` (full mode): load the frozen reference copy; default: when
    ``algo.beta > 0`` or ``algo.use_kl_in_reward``. ``need_critic``: build the critic
    (lora: the ``critic`` adapter; full: the critic model) and the value head; default:
    when the advantage estimator uses values (``gae``), not for GRPO, RLOO or REINFORCE++.
    """
    m = cfg.model
    attn = attention_implementation(m.attn_implementation, device)
    if need_reference is None:
        need_reference = cfg.algo.beta > 0 or cfg.algo.use_kl_in_reward
    if need_critic is None:
        need_critic = cfg.uses_critic
    if seed is not None:
        torch.manual_seed(seed)
    lm = load_causal_lm(model_path, "model.path", attn_implementation=attn)
    hidden = _hidden_size(lm)
    if m.mode == "lora":
        from peft import get_peft_model

        lm.requires_grad_(False)
        names = linear_module_names(lm)      # before peft wraps them
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)   # peft asks a deprecated transformers property
                # GPT-2's Conv1D layers: peft says it sets fan_in_fan_out itself, which it does
                warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False", category=UserWarning)
                peft_model = get_peft_model(lm, lora_config(m), adapter_name=ACTOR)
                if need_critic:
                    peft_model.add_adapter(CRITIC, lora_config(m))
        except ValueError as exc:
            if "not found in the base model" not in str(exc):
                raise
            raise UserError(f"model.lora_target_modules={m.lora_target_modules}: no such module in {model_path}; "
                            f"its linear layers are {', '.join(names)} (or use all-linear)") from None
        policy = LMPolicy(peft_model, ValueHead(hidden) if need_critic else None, mode="lora",
                          temperature=cfg.rollout.temperature, autocast_dtype=autocast_dtype)
    else:
        critic = _load_critic(m, model_path, lm, attn) if need_critic else None
        ref = load_causal_lm(model_path, "model.path", attn_implementation=attn).requires_grad_(False) \
            if need_reference else None
        policy = LMPolicy(lm, ValueHead(_hidden_size(critic)) if need_critic else None, mode="full",
                          temperature=cfg.rollout.temperature, autocast_dtype=autocast_dtype, critic_lm=critic,
                          ref_lm=ref)
    policy.to(device)
    policy.cast_frozen_weights(autocast_dtype)
    if m.cpu_kernels:
        policy.fuse_cpu_kernels()
    return policy


def _load_critic(m, model_path: str | Path, lm: nn.Module, attn: Optional[str]) -> nn.Module:
    """Full mode's critic model: ``model.critic_path`` (or the policy's path), its LM head frozen."""
    critic_path = m.critic_path or model_path
    critic = load_causal_lm(critic_path, "model.critic_path" if m.critic_path else "model.path",
                            attn_implementation=attn)
    vocab, critic_vocab = _vocab_size(lm), _vocab_size(critic)
    if critic_vocab < vocab:
        raise UserError(f"model.critic_path={critic_path}: the critic embeds {critic_vocab} tokens but the "
                        f"policy (model.path={model_path}) and its tokenizer use {vocab}; give a critic with "
                        "the policy's tokenizer and vocabulary (or leave model.critic_path null)")
    out_emb = critic.get_output_embeddings()
    if out_emb is not None and out_emb.weight is not critic.get_input_embeddings().weight:
        out_emb.requires_grad_(False)   # the critic's LM head is unused
    return critic


def attention_implementation(name: str, device: torch.device) -> Optional[str]:
    """``auto``: eager attention on CPU (its backward is about twice as fast there as the
    CPU SDPA kernel's at the short lengths a CPU trains), the model's default elsewhere."""
    if name == "auto":
        return "eager" if torch.device(device).type == "cpu" else None
    return name


def linear_module_names(lm: nn.Module) -> list[str]:
    """The distinct names of a model's linear layers: what ``model.lora_target_modules`` can name."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in lm.named_modules()
                   if name and (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D")})


def _vocab_size(lm: nn.Module) -> int:
    """Rows of the input embedding: the token ids a model can read."""
    return int(lm.get_input_embeddings().weight.shape[0])


def _hidden_size(lm: nn.Module) -> int:
    config = lm.config
    get = getattr(config, "get_text_config", None)
    text = get() if callable(get) else config
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(text, name, None):
            return int(getattr(text, name))
    return int(lm.get_input_embeddings().weight.shape[1])


def load_policy(ckpt_dir: str | Path, *, device: torch.device | str = "cpu",
                autocast_dtype: Optional[torch.dtype] = None, trainable: bool = False,
                attn_implementation: str = "auto", cpu_kernels: bool = True) -> LMPolicy:
    """Reload a policy saved by :meth:`LMPolicy.save` (the reference of lora mode comes with it);
    ``cpu_kernels`` as ``model.cpu_kernels``."""
    ckpt = Path(ckpt_dir)
    meta = read_policy_meta(ckpt)
    attn = attention_implementation(attn_implementation, torch.device(device))
    critic = meta["critic"]
    policy_kwargs: dict[str, Any] = {}
    if meta["mode"] == "lora":
        base = load_causal_lm(base_model_of(ckpt), "the checkpoint's base model", attn_implementation=attn)
        lm = load_adapter(base, ckpt, ACTOR, trainable=trainable)
        if critic:
            lm = load_adapter(lm, ckpt, CRITIC, trainable=trainable)
    else:
        lm = load_causal_lm(ckpt / ACTOR, "the checkpoint's actor", attn_implementation=attn)
        if critic:
            policy_kwargs["critic_lm"] = load_causal_lm(ckpt / CRITIC, "the checkpoint's critic",
                                                        attn_implementation=attn)
    head = _load_value_head(ckpt, int(meta["hidden_size"])) if critic else None
    policy = LMPolicy(lm, head, mode=meta["mode"], temperature=meta.get("temperature", 1.0),
                      autocast_dtype=autocast_dtype, **policy_kwargs)
    if not trainable:
        policy.freeze()
    policy.to(device)
    policy.cast_frozen_weights(autocast_dtype)
    if cpu_kernels:
        policy.fuse_cpu_kernels()
    return policy
