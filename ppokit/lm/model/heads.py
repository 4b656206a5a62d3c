"""A causal LM's body and output layer, taken apart: logits at chosen positions only.

``lm(x).logits`` is ``lm_head(decoder(x).last_hidden_state)`` for Llama/Qwen/Mistral/GPT-2-like
models; reading the decoder's states and applying the head to the positions that need logits
keeps the (B, T, V) tensor from ever existing (the policy's log-probs, the warm start's answer
loss). Models that post-process their logits (soft-capping, logit scales) are told apart once
by :func:`hidden_then_head_matches` and take the full logits.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

_MATCHES: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def decoder_of(lm: nn.Module) -> nn.Module:
    """The transformer body of a causal LM (the peft wrapper is looked through)."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    return base.get_decoder()


def plain_head(lm: nn.Module) -> nn.Linear | None:
    """The model's ``lm_head`` when it is a plain linear layer (its logits are ``h W^T + b``), else
    None (a LoRA adapter on it: peft's layer adds the adapter's product)."""
    head = lm.get_output_embeddings()
    return head if isinstance(head, nn.Linear) else None


def hidden_then_head_matches(lm: nn.Module) -> bool:
    """Whether ``lm_head(decoder(x).last_hidden_state)`` equals ``lm(x).logits`` (asked once per
    model: a 4-token forward pass both ways).

    True for Llama/Qwen/Mistral/GPT-2-like models; False for models that post-process
    logits (soft-capping, logit scales), which then take the full-logits path.
    """
    if lm not in _MATCHES:
        _MATCHES[lm] = _compare_paths(lm)
    return _MATCHES[lm]


def _compare_paths(lm: nn.Module) -> bool:
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    try:
        decoder, head = base.get_decoder(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError, ValueError):
        return False
    if decoder is None or head is None or decoder is base:
        return False
    device = next(base.parameters()).device
    ids = torch.arange(1, 5, device=device)[None] % max(2, base.config.vocab_size)
    was_training = base.training
    base.eval()  # a model in training with dropout would differ between the two passes
    with torch.no_grad():
        try:
            full = base(input_ids=ids, use_cache=False).logits
            split = head(decoder(input_ids=ids, use_cache=False).last_hidden_state)
        except Exception:  # noqa: BLE001 - any failure means "use the general path"
            return False
        finally:
            base.train(was_training)
    return full.shape == split.shape and torch.allclose(full, split, rtol=1e-4, atol=1e-5)


def logits_at(lm: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The logits at the positions ``keep`` marks, (n, V) for ``n = keep.sum()``.

    ``input_ids``, ``attention_mask``, ``keep`` (B, T). Where the head follows the decoder only the
    ``n`` kept states go through it; otherwise the full (B, T, V) logits are computed and indexed."""
    if hidden_then_head_matches(lm):
        hidden = decoder_of(lm)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return lm.get_output_embeddings()(hidden[keep])  # (n, H) -> (n, V)
    return lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[keep]  # (n, V)
