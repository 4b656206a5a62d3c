"""Language-model checkpoints: the policy's files and reading them back.

A checkpoint directory written by :func:`save_policy`::

    policy.json                 mode, critic or not, the backbone's directory (lora), temperature
    actor/, critic/             lora: the peft adapters (adapter_config.json, adapter_model.safetensors);
                                full: whole Hugging Face models
    value_head.safetensors      with a critic
    tokenizer files

It loads with peft and transformers alone: :func:`load_policy` for inference (``ppokit
eval``), ``ppokit export`` to merge the actor into a standalone model, and
:func:`load_trained_state` into a freshly built policy for an exact resume. Which checkpoint
of a run directory is read, and the config it was trained with, is
:class:`ppokit.persistence.rundir.RunDir`'s (``lm_checkpoint``, ``config()``); it knows a policy by its
``policy.json`` (:data:`POLICY_META_FILE`). This module owns the policy's other file names.
A missing, damaged or ill-fitting file is a one-line :class:`~ppokit.errors.UserError` naming it.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ppokit.errors import UserError, first_line
from ppokit.lm.model.device import attention_implementation
from ppokit.lm.model.hf import load_causal_lm
from ppokit.lm.model.policy import ACTOR, CRITIC, LMPolicy, ValueHead
from ppokit.persistence.checkpoint_files import read_json_file
from ppokit.persistence.rundir import POLICY_META_FILE

VALUE_HEAD_FILE = "value_head.safetensors"


def save_policy(policy: LMPolicy, out_dir: str | Path, *, base_model: str, tokenizer=None) -> Path:
    """Adapters (peft format, ``actor/`` and ``critic/``) or full models, plus the value head
    (the actor alone without a critic; ``policy.json`` says which).

    ``base_model`` is the directory the backbone came from (recorded in
    ``policy.json`` so that the checkpoint can be reloaded and exported).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if policy.mode == "lora":
        # peft writes an adapter not named "default" into a sub-folder of its name:
        # out/actor/adapter_model.safetensors, out/critic/...
        policy.lm.save_pretrained(str(out), selected_adapters=list(policy.adapter_names), save_embedding_layers=False)
    else:
        policy.lm.save_pretrained(str(out / ACTOR))
        if policy.has_critic:
            policy.critic_lm.save_pretrained(str(out / CRITIC))
    if policy.has_critic:
        save_file(
            {k: v.detach().float().contiguous().cpu() for k, v in policy.value_head.state_dict().items()},
            str(out / VALUE_HEAD_FILE),
        )
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    meta = {
        "mode": policy.mode,
        "base_model": _portable_path(Path(base_model), out),
        "temperature": policy.temperature,
        "critic": policy.has_critic,
    }
    if policy.has_critic:
        meta["hidden_size"] = policy.value_head.linear.in_features
    (out / POLICY_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def load_trained_state(policy: LMPolicy, ckpt_dir: str | Path) -> None:
    """Load the trained weights of a checkpoint written by :func:`save_policy` into this policy.

    For exact resume: the policy is built as for a fresh run (same construction, so
    the optimizer sees the parameters in the same order), then the adapters or full
    models and the value head are copied in. A file that is missing, damaged or does
    not fit is a :class:`UserError` naming it.
    """
    ckpt = Path(ckpt_dir)
    meta = read_policy_meta(ckpt)
    if meta["mode"] != policy.mode:
        raise UserError(f"checkpoint {ckpt} holds a {meta['mode']} policy, this run trains a {policy.mode} one")
    if policy.has_critic and not meta["critic"]:
        raise UserError(
            f"checkpoint {ckpt} has no critic (it was trained with a critic-free "
            "algo.adv_estimator), but this run trains one (gae); resume it with its own estimator"
        )

    def read(file: Path) -> dict[str, Tensor]:
        if not file.is_file():
            raise UserError(f"checkpoint file {file} is missing")
        try:
            return load_file(str(file))
        except (SafetensorError, OSError) as exc:
            raise UserError(f"checkpoint file {file} is corrupt or truncated ({first_line(exc)})") from None

    try:
        with torch.no_grad():
            if policy.mode == "lora":
                for name in policy.adapter_names:  # a checkpoint's unused critic is left out
                    file = ckpt / name / "adapter_model.safetensors"
                    state = read(file)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        result = set_peft_model_state_dict(policy.lm, state, adapter_name=name)
                    loaded = len(state) - len(getattr(result, "unexpected_keys", []) or [])
                    if getattr(result, "unexpected_keys", None) or loaded != len(policy.adapter_parameters(name)):
                        raise UserError(
                            f"checkpoint file {file} does not fit this model's {name} adapter "
                            f"({loaded} of {len(policy.adapter_parameters(name))} LoRA tensors)"
                        )
            else:
                for name, lm in ((ACTOR, policy.lm), (CRITIC, policy.critic_lm)):
                    if lm is not None:
                        _load_hf_weights(lm, ckpt / name, read)
            if policy.has_critic:
                policy.value_head.load_state_dict(read(ckpt / VALUE_HEAD_FILE))
    except (RuntimeError, KeyError, ValueError) as exc:
        raise UserError(f"checkpoint {ckpt} does not fit this run's model ({first_line(exc)})") from None
    policy.reset_adapters()


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
    tied = {
        k
        for k in own
        if k not in state and any(own[k] is own[o] or own[k].data_ptr() == own[o].data_ptr() for o in state if o in own)
    }
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
    head = ValueHead(hidden_size)
    head_file = ckpt / VALUE_HEAD_FILE
    if not head_file.is_file():
        raise UserError(f"checkpoint file {head_file} is missing")
    try:
        head.load_state_dict(load_file(str(head_file)))
    except (SafetensorError, OSError) as exc:
        raise UserError(f"checkpoint file {head_file} is corrupt or truncated ({first_line(exc)})") from None
    except (RuntimeError, KeyError) as exc:
        raise UserError(
            f"checkpoint file {head_file} does not fit hidden_size={hidden_size} ({first_line(exc)})"
        ) from None
    return head


def read_policy_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    """``policy.json`` of a checkpoint, checked; a missing or damaged file is a UserError naming it."""
    ckpt = Path(ckpt_dir)
    path = ckpt / POLICY_META_FILE
    if not path.is_file():
        raise UserError(f"{ckpt} is not a ppokit LM checkpoint (no {POLICY_META_FILE})")
    meta = read_json_file(path)
    if not isinstance(meta, dict):
        raise UserError(f"checkpoint file {path} is corrupt: expected a JSON object")
    if meta.get("mode") not in ("lora", "full"):
        raise UserError(f"checkpoint file {path} is corrupt: mode is {meta.get('mode')!r}, expected 'lora' or 'full'")
    if meta["mode"] == "lora" and not isinstance(meta.get("base_model"), str):
        raise UserError(
            f"checkpoint file {path} is corrupt: a lora checkpoint needs base_model (the backbone directory)"
        )
    meta.setdefault("critic", True)  # checkpoints before critic-free policies always had one
    if not isinstance(meta["critic"], bool):
        raise UserError(f"checkpoint file {path} is corrupt: critic is {meta['critic']!r}, expected true or false")
    if meta["critic"] and (isinstance(meta.get("hidden_size"), bool) or not isinstance(meta.get("hidden_size"), int)):
        raise UserError(f"checkpoint file {path} is corrupt: hidden_size is {meta.get('hidden_size')!r}")
    return meta


def load_adapter(lm: nn.Module, ckpt_dir: str | Path, name: str, *, trainable: bool = False) -> nn.Module:
    """Put the peft adapter ``ckpt_dir/name`` on ``lm`` (a base model, or a PeftModel for a second
    adapter); a missing or damaged adapter file is a UserError naming it."""
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
        raise UserError(
            f"checkpoint file {folder / 'adapter_model.safetensors'} is corrupt or truncated ({first_line(exc)})"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(
            f"checkpoint file {folder / 'adapter_config.json'} is corrupt or truncated ({type(exc).__name__})"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise UserError(
            f"checkpoint {folder}: cannot load the {name} adapter onto the base model ({first_line(exc)})"
        ) from None


def base_model_of(ckpt_dir: str | Path, meta: dict[str, Any] | None = None) -> Path:
    """The backbone directory a checkpoint was trained from (lora mode); ``meta``: its
    :func:`read_policy_meta`, when already read."""
    ckpt = Path(ckpt_dir)
    meta = read_policy_meta(ckpt) if meta is None else meta
    path = Path(meta["base_model"])
    return path if path.is_absolute() else (ckpt / path).resolve()


def load_policy(
    ckpt_dir: str | Path,
    *,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
    trainable: bool = False,
    attn_implementation: str | None = "auto",
    with_critic: bool = True,
) -> LMPolicy:
    """Reload a policy saved by :func:`save_policy` (the reference of lora mode comes with it).
    ``attn_implementation``: ``auto`` is :func:`~ppokit.lm.model.device.attention_implementation`'s
    choice for ``device``; another value (None: the model's default) is used as it is.
    ``with_critic=False``: the actor alone, for sampling (full mode: the critic's whole model is
    not loaded; lora: neither its adapter nor the value head)."""
    ckpt = Path(ckpt_dir)
    attn = attn_implementation
    if attn == "auto":
        attn = attention_implementation(attn, torch.device(device))
    meta = read_policy_meta(ckpt)
    critic = meta["critic"] and with_critic
    policy_kwargs: dict[str, Any] = {}
    if meta["mode"] == "lora":
        base = load_causal_lm(base_model_of(ckpt, meta), "the checkpoint's base model", attn_implementation=attn)
        lm = load_adapter(base, ckpt, ACTOR, trainable=trainable)
        if critic:
            lm = load_adapter(lm, ckpt, CRITIC, trainable=trainable)
    else:
        lm = load_causal_lm(ckpt / ACTOR, "the checkpoint's actor", attn_implementation=attn)
        if critic:
            policy_kwargs["critic_lm"] = load_causal_lm(
                ckpt / CRITIC, "the checkpoint's critic", attn_implementation=attn
            )
    head = _load_value_head(ckpt, int(meta["hidden_size"])) if critic else None
    policy = LMPolicy(
        lm,
        head,
        mode=meta["mode"],
        temperature=meta.get("temperature", 1.0),
        autocast_dtype=autocast_dtype,
        **policy_kwargs,
    )
    if not trainable:
        policy.freeze()
    policy.to(device)
    policy.cast_frozen_weights(autocast_dtype)
    return policy
