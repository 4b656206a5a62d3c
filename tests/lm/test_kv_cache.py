"""The preallocated KV cache (ppokit.lm.accel.kv_cache) generates what transformers' dynamic cache does."""

from __future__ import annotations

import pytest
import torch

from ppokit.lm.accel.kv_cache import preallocated_cache
from ppokit.lm.generation.engine import GENERATE_CACHE_KWARG


def tiny_llama(dtype, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def greedy(model, ids, mask, cache=None, new=7):
    extra = {GENERATE_CACHE_KWARG: cache} if cache is not None else {}
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **extra,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("capacity", [13, 4])  # prompt + new tokens, and a buffer that must grow
def test_generation_with_the_preallocated_cache_equals_the_dynamic_cache(dtype, kernels, capacity):
    from ppokit.lm.accel.kernels import cpu_library
    from ppokit.lm.accel.kernels.fuse import fuse_cpu_kernels

    if kernels and cpu_library() is None:
        pytest.skip("no C compiler: the kernels are not built")
    model = tiny_llama(dtype)
    if kernels:
        fuse_cpu_kernels(model)
    ids = torch.randint(1, 50, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row
    plain = greedy(model, ids, mask)
    cache = preallocated_cache(model, capacity)
    ours = greedy(model, ids, mask, cache)
    assert torch.equal(ours.sequences, plain.sequences)
    for a, b in zip(ours.scores, plain.scores):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4 if dtype == torch.float32 else 0.05)
    layer = cache.layers[0]
    assert cache.get_seq_length() == 6 + 7 - 1 == layer.keys.shape[2]  # the last token is not cached
    assert layer._keys.shape[2] >= 12 and layer.keys.data_ptr() == layer._keys.data_ptr()  # a view
    cache.reset()
    assert cache.get_seq_length() == 0
    again = greedy(model, ids, mask, cache)  # a reset cache is reused
    assert torch.equal(again.sequences, plain.sequences)


def test_models_with_other_layer_types_keep_transformers_cache():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
    )
    assert preallocated_cache(Qwen2ForCausalLM(config), 16) is None
    assert preallocated_cache(tiny_llama(torch.float32), 16) is not None


def test_the_rollout_engine_preallocates_where_the_decoding_kernel_runs(tiny_dir):
    from ppokit.config import build_config
    from ppokit.lm.accel import accelerate_policy
    from ppokit.lm.accel.kernels import cpu_library
    from ppokit.lm.generation.factory import make_engine
    from ppokit.lm.model.hf import load_tokenizer
    from ppokit.lm.model.policy import build_policy

    def engine(dtype=torch.bfloat16, accelerate=True, **model):
        cfg = build_config(
            [
                {
                    "workload": "lm",
                    "model": {"path": str(tiny_dir), **model},
                    "rollout": {"max_new_tokens": 4},
                    "run": {"progress": False, "tensorboard": False},
                }
            ]
        )
        policy = build_policy(cfg, tiny_dir, device=torch.device("cpu"), autocast_dtype=dtype)
        kv_cache = accelerate_policy(policy).kv_cache if accelerate else None
        return make_engine(policy, load_tokenizer(tiny_dir), cfg.rollout, kv_cache=kv_cache)

    assert engine(accelerate=False).kv_cache is None
    assert engine(mode="full").kv_cache is None  # fp32 keys beside bf16 values: eager
    assert (engine(None, mode="full").kv_cache is not None) is (cpu_library() is not None)
    fused = engine()
    assert (fused.kv_cache is not None) is (cpu_library() is not None)
    made = []
    if fused.kv_cache is not None:  # record the caches handed to generate
        make = fused.kv_cache
        fused.kv_cache = lambda model, capacity: made.append(make(model, capacity)) or made[-1]
    batch = fused.generate(["12+3=", "7="], group_size=2)
    assert batch.responses.shape[0] == 4 and batch.mask.sum() > 0
    assert all(cache.get_seq_length() > 0 for cache in made)  # generate filled them: the keyword reached it


def test_batch_operations_and_crop_act_on_the_filled_part():
    from transformers.cache_utils import DynamicLayer

    cache = preallocated_cache(tiny_llama(torch.float32), 8)
    ours, theirs = cache.layers[0], DynamicLayer()
    g = torch.Generator().manual_seed(2)
    for n in (3, 1, 1):  # a prompt of 3, then two decoding steps
        k, v = torch.randn(2, 2, n, 4, generator=g), torch.randn(2, 2, n, 4, generator=g)
        ours.update(k, v)
        theirs.update(k, v)
    checks = [
        lambda layer: layer.batch_repeat_interleave(2),
        lambda layer: layer.batch_select_indices(torch.tensor([3, 0, 1])),
        lambda layer: layer.reorder_cache(torch.tensor([2, 2, 0])),
        lambda layer: layer.crop(-2),
    ]
    for change in checks:
        change(ours)
        change(theirs)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert ours.get_seq_length() == theirs.get_seq_length()
    k, v = torch.randn(3, 2, 1, 4, generator=g), torch.randn(3, 2, 1, 4, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(ours.update(k, v), theirs.update(k, v)))  # and it goes on
