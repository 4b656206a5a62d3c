"""The CUDA engine (ppokit.lm.generation.cuda_engine) decodes what the HF engine and the policy compute.

On the CPU the engine runs its decoding loop eagerly (the same code, no graphs): greedy tokens
equal to the HF engine's, behaviour log-probs equal to the model's own forward (float32),
the LoRA adapter folded as peft merges it, the refresh after an update, mixed prompt lengths,
EOS, chunks and buckets. On CUDA (``bench/gpu_check.py``) the captured graphs must decode what
the eager loop does.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from lm_helpers import randomize

from ppokit.config import build_config
from ppokit.lm.generation.base import EngineMemory, sampling_log_probs
from ppokit.lm.generation.cuda_engine import CudaEngine, batch_bucket, length_bucket
from ppokit.lm.generation.decoder import unsupported_reason
from ppokit.lm.generation.engine import HFEngine
from ppokit.lm.model.hf import load_causal_lm, load_tokenizer
from ppokit.lm.model.policy import build_policy

# peft's notes when the LM head is adapted: it saves the head's base layer with the adapter, and
# merging into a head tied to the embedding changes both (the engine folds into a copy of the head)
pytestmark = [
    pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`:UserWarning"),
    pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning"),
    pytest.mark.filterwarnings("ignore:Model with `tie_word_embeddings=True`:UserWarning"),
]
CPU = torch.device("cpu")
PROMPTS = ["12+34=", "7=", "100-1=", "(2*3)+(4*5)="]  # lengths 7, 3, 7, 13 with <bos>: mixed


@pytest.fixture(scope="module")
def qwen_dir(tiny_dir, tmp_path_factory):
    """A tiny Qwen2-shaped model (grouped-query attention, q/k/v biases, tied embeddings) with
    the tiny model's character tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = load_tokenizer(tiny_dir)
    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 if p.dim() == 1 else 0.15)  # biases and norms away from 0 and 1
    out = tmp_path_factory.mktemp("qwen") / "model"
    model.save_pretrained(out)
    for f in tiny_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request, tiny_dir, qwen_dir):
    return tiny_dir if request.param == "llama" else qwen_dir


WITH_HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def config(model_dir, mode="lora", targets="all-linear", **rollout):
    return build_config(
        [
            {
                "workload": "lm",
                "model": {"path": str(model_dir), "mode": mode, "lora_target_modules": targets},
                "rollout": {"max_new_tokens": 12, **rollout},
                "run": {"progress": False, "tensorboard": False},
            }
        ]
    )


def lora_policy(model_dir, mode="lora", seed=0, targets="all-linear", **rollout):
    cfg = config(model_dir, mode, targets, **rollout)
    policy = build_policy(cfg, model_dir, device=CPU, autocast_dtype=None, seed=0)
    randomize(policy, std=0.3, seed=seed)  # a non-zero adapter: folding it changes the weights
    return cfg, policy


def plain_model(model_dir):
    return load_causal_lm(model_dir, "model.path").eval().requires_grad_(False)


# ----------------------------------------------------------------------------- buckets
def test_batch_and_length_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 64, 65, 256)] == [1, 2, 4, 8, 64, 128, 256]
    with pytest.raises(ValueError):
        batch_bucket(257)
    with pytest.raises(ValueError):
        batch_bucket(0)
    assert [length_bucket(n) for n in (1, 64, 65, 96, 97, 192, 193, 1536, 1537)] == [
        64,
        64,
        96,
        96,
        128,
        192,
        256,
        1536,
        2048,
    ]


def test_a_chunk_runs_at_its_bucket_and_the_cache_is_allocated_once(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    engine = CudaEngine.for_model(plain_model(tiny_dir), tok, config(tiny_dir).rollout)
    engine.generate(PROMPTS[:3], greedy=True)  # 3 rows, prompts of 7 + 12 new tokens
    assert list(engine.runners) == [(4, 64)]
    storage = engine.cache.storage
    engine.generate(PROMPTS[:1], group_size=2, greedy=True)
    assert list(engine.runners) == [(4, 64), (2, 64)] and engine.cache.storage is storage  # reused


# ----------------------------------------------------------------------------- greedy = HF
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_greedy_tokens_equal_the_hf_engines(model_dir, mode):
    cfg, policy = lora_policy(model_dir, mode)
    tok = load_tokenizer(model_dir)
    hf = HFEngine.for_policy(policy, tok, cfg.rollout).generate(PROMPTS, greedy=True)
    ours = CudaEngine.for_policy(policy, tok, cfg.rollout).generate(PROMPTS, greedy=True)
    for key in ("input_ids", "attention_mask", "position_ids", "responses", "mask", "truncated"):
        assert torch.equal(getattr(ours, key), getattr(hf, key)), key
    assert ours.texts == hf.texts and ours.rollout_log_prob is None
    assert ours.prompts == PROMPTS and torch.equal(ours.group_ids, torch.arange(4))


def test_a_short_prompt_decodes_in_a_batch_as_it_does_alone(qwen_dir):
    tok = load_tokenizer(qwen_dir)
    engine = CudaEngine.for_model(plain_model(qwen_dir), tok, config(qwen_dir).rollout)
    batch = engine.generate(PROMPTS, greedy=True)
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], greedy=True)
        n = int(alone.mask.sum())
        assert torch.equal(batch.responses[i, :n], alone.responses[0, :n]), prompt


def test_chunks_smaller_than_the_batch_give_the_same_tokens(qwen_dir):
    tok = load_tokenizer(qwen_dir)
    model = plain_model(qwen_dir)
    whole = CudaEngine.for_model(model, tok, config(qwen_dir).rollout).generate(PROMPTS, group_size=2, greedy=True)
    small = CudaEngine.for_model(model, tok, config(qwen_dir).rollout, max_batch_size=2)
    chunked = small.generate(PROMPTS, group_size=2, greedy=True)  # 8 rows in 4 chunks of 2
    assert torch.equal(chunked.input_ids, whole.input_ids)
    odd = CudaEngine.for_model(model, tok, config(qwen_dir).rollout, max_batch_size=4)
    threes = odd.generate(PROMPTS[:3], group_size=3, greedy=True)  # rows 0-3, 4-7, 8: groups split across chunks
    expected = whole.responses[[0, 0, 0, 2, 2, 2, 4, 4, 4]]  # (9, R') with R' >= R: PROMPTS[3] may run longer
    R = threes.responses.shape[1]
    assert torch.equal(threes.responses, expected[:, :R]) and (expected[:, R:] == tok.pad_token_id).all()
    assert torch.equal(threes.group_ids, torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2]))


@pytest.mark.parametrize("kind", ["qwen3", "mistral", "llama3-rope"])
def test_other_families_decode_as_transformers_does(tiny_dir, kind):
    """Qwen3 (q/k norms per head), Mistral without a window, Llama 3's rope scaling: greedy tokens
    equal to the HF engine's, sampled log-probs equal to the model's forward."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    tok = load_tokenizer(tiny_dir)
    shape = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    shape.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(4)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=24))  # head_dim not hidden / heads
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**shape, sliding_window=None))
    else:
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0}
        rope.update(high_freq_factor=4.0, original_max_position_embeddings=16)
        model = LlamaForCausalLM(LlamaConfig(**shape, rope_parameters=rope))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 if p.dim() == 1 else 0.15)
    model.eval().requires_grad_(False)
    assert unsupported_reason(model) is None
    cfg = config(tiny_dir, temperature=0.8).rollout
    ours = CudaEngine.for_model(model, tok, cfg)
    assert torch.equal(
        ours.generate(PROMPTS, greedy=True).input_ids,
        HFEngine.for_model(model, tok, cfg).generate(PROMPTS, greedy=True).input_ids,
    )
    torch.manual_seed(0)
    batch = ours.generate(PROMPTS, group_size=2)
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits
    R, P = batch.responses.shape[1], batch.prompt_length
    lp = torch.log_softmax(logits[:, P - 1 : P - 1 + R].float() / 0.8, -1).gather(2, batch.responses[..., None])[..., 0]
    torch.testing.assert_close(batch.rollout_log_prob, lp * batch.mask, rtol=1e-5, atol=2e-5)


def test_generate_ids_is_generate_from_token_ids(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    engine = CudaEngine.for_model(plain_model(tiny_dir), tok, config(tiny_dir).rollout)
    by_text = engine.generate(PROMPTS, greedy=True)
    by_ids = engine.generate_ids(tok(PROMPTS)["input_ids"], greedy=True, max_new_tokens=12)
    assert torch.equal(by_ids.input_ids, by_text.input_ids) and by_ids.prompts == PROMPTS


# ----------------------------------------------------------------------------- log-probs
def forward_sampling_log_probs(policy, batch, temperature, top_k, top_p):
    """(N, R) log-probs of the sampled tokens under the warped distribution of the policy's own forward."""
    lm = policy.lm
    with torch.no_grad(), policy.use("actor"):
        logits = lm(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits  # (N, P + R, V)
    R = batch.responses.shape[1]
    logits = logits[:, batch.prompt_length - 1 : batch.prompt_length - 1 + R]  # (N, R, V)
    lp = sampling_log_probs(logits.flatten(0, 1), temperature, top_k, top_p).view(*logits.shape)
    out = lp.gather(2, batch.responses[..., None])[..., 0]
    return torch.where(batch.mask.bool(), out, torch.zeros_like(out))


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_behaviour_log_probs_equal_the_policys_forward(model_dir, mode):
    cfg, policy = lora_policy(model_dir, mode, temperature=0.7)
    tok = load_tokenizer(model_dir)
    torch.manual_seed(0)
    batch = CudaEngine.for_policy(policy, tok, cfg.rollout).generate(PROMPTS, group_size=3)
    scored = policy.log_probs(batch.tensors())["log_prob"] * batch.mask  # the scorer's
    torch.testing.assert_close(batch.rollout_log_prob, scored, rtol=1e-5, atol=2e-5)
    assert batch.rollout_log_prob.shape == batch.mask.shape and (batch.rollout_log_prob[batch.mask == 0] == 0).all()


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.8), (8, 0.9)])
def test_behaviour_log_probs_under_top_k_and_top_p(qwen_dir, top_k, top_p):
    cfg, policy = lora_policy(qwen_dir, temperature=1.3, top_k=top_k, top_p=top_p)
    tok = load_tokenizer(qwen_dir)
    torch.manual_seed(1)
    batch = CudaEngine.for_policy(policy, tok, cfg.rollout).generate(PROMPTS, group_size=4)
    expected = forward_sampling_log_probs(policy, batch, 1.3, top_k, top_p)
    assert torch.isfinite(expected).all()  # every sampled token is inside the top-k / top-p set
    torch.testing.assert_close(batch.rollout_log_prob, expected, rtol=1e-5, atol=2e-5)


def test_samples_follow_the_warped_distribution():
    """Gumbel-max draws against the softmax of transformers' warpers (20,000 draws, 5 sigma)."""
    from types import SimpleNamespace

    engine = object.__new__(CudaEngine)
    engine.cfg = SimpleNamespace(temperature=0.8, top_k=4, top_p=0.9)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 3.0, -1.0]]).repeat(20000, 1)
    torch.manual_seed(0)
    tokens, lp = engine._sample(logits, greedy=False)
    p = sampling_log_probs(logits[:1], 0.8, 4, 0.9).exp()[0]  # (V,)
    freq = torch.bincount(tokens, minlength=6).double() / len(tokens)
    sigma = (p.double() * (1 - p.double()) / len(tokens)).sqrt()
    assert ((freq - p.double()).abs() <= 5 * sigma + 1e-12).all(), (freq, p)
    assert freq[p == 0].sum() == 0  # nothing outside the top-k / top-p set
    torch.testing.assert_close(lp, p.log()[tokens])
    greedy, none = engine._sample(logits[:2], greedy=True)
    assert greedy.tolist() == [4, 4] and none is None


# ----------------------------------------------------------------------------- weights
@pytest.mark.parametrize("targets", ["all-linear", WITH_HEAD])
def test_the_folded_adapter_equals_peft_merged_weights(model_dir, targets):
    cfg, policy = lora_policy(model_dir, targets=targets)
    engine = CudaEngine.for_policy(policy, load_tokenizer(model_dir), cfg.rollout)
    merged = copy.deepcopy(policy.lm).merge_and_unload(adapter_names=["actor"])
    head, embed = merged.get_output_embeddings().weight, merged.get_input_embeddings().weight
    torch.testing.assert_close(engine.weights.lm_head, head, rtol=0, atol=1e-6)
    if targets == WITH_HEAD:  # the head folded on its own copy; the embedding (tied or not) unchanged
        base = policy.lm.get_base_model()
        assert not torch.allclose(engine.weights.lm_head, base.lm_head.base_layer.weight)
        torch.testing.assert_close(engine.weights.embed, base.get_input_embeddings().weight, rtol=0, atol=0)
    else:
        assert (engine.weights.lm_head is engine.weights.embed) == (head is embed)
    for layer, block in zip(engine.weights.layers, merged.model.layers):
        a, m = block.self_attn, block.mlp
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        torch.testing.assert_close(layer.qkv, qkv, rtol=0, atol=1e-6)
        torch.testing.assert_close(layer.o, a.o_proj.weight, rtol=0, atol=1e-6)
        torch.testing.assert_close(layer.gate_up, torch.cat([m.gate_proj.weight, m.up_proj.weight]), rtol=0, atol=1e-6)
        torch.testing.assert_close(layer.down, m.down_proj.weight, rtol=0, atol=1e-6)
    base = policy.lm.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.allclose(engine.weights.layers[0].qkv[: base.shape[0]], base)  # the adapter did change it


@pytest.mark.parametrize(("targets", "bucketed"), [("all-linear", False), (WITH_HEAD, False), ("all-linear", True)])
def test_lora_refresh_refolds_the_adapter_from_its_state_dict(model_dir, targets, bucketed):
    from peft import get_peft_model_state_dict

    cfg, policy = lora_policy(model_dir, targets=targets, temperature=0.9)
    tok = load_tokenizer(model_dir)
    engine = CudaEngine.for_policy(policy, tok, cfg.rollout)
    base = engine.weights.layers[0].ln1
    randomize(policy, std=0.3, seed=7)  # an update changes the actor adapter

    def mismatch():
        torch.manual_seed(2)
        batch = engine.generate(PROMPTS, group_size=2)
        scored = policy.log_probs(batch.tensors())["log_prob"] * batch.mask
        return (batch.rollout_log_prob - scored).abs().max().item()

    assert mismatch() > 1e-2  # stale weights: the test can fail
    state = get_peft_model_state_dict(policy.lm, adapter_name="actor")
    if bucketed:  # one tensor per bucket (ppokit.cluster.weights): each module's A and B come apart
        for name, tensor in state.items():
            engine.load_weights({name: tensor})
        assert not engine.weights.pending_halves
    else:
        engine.load_weights(state)
    assert mismatch() < 1e-4
    assert engine.weights.layers[0].ln1 is base  # untouched tensors stay as they are
    with pytest.raises(RuntimeError, match="not in the engine's adapter"):
        engine.load_weights({"base_model.model.nowhere.lora_A.weight": torch.zeros(1)})


def test_full_refresh_copies_the_actors_weights(qwen_dir):
    cfg, policy = lora_policy(qwen_dir, "full", temperature=0.9)
    tok = load_tokenizer(qwen_dir)
    engine = CudaEngine.for_policy(policy, tok, cfg.rollout)
    with torch.no_grad():
        for p in policy.lm.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # an update of every weight, the tied embedding too
    torch.manual_seed(2)
    batch = engine.generate(PROMPTS)
    assert (batch.rollout_log_prob - policy.log_probs(batch.tensors())["log_prob"] * batch.mask).abs().max() > 1e-2
    engine.load_weights(policy.lm.state_dict())
    torch.manual_seed(2)
    batch = engine.generate(PROMPTS)
    torch.testing.assert_close(batch.rollout_log_prob, policy.log_probs(batch.tensors())["log_prob"] * batch.mask)


def test_memory_counts_its_own_weights_and_the_cache(tiny_dir):
    cfg, policy = lora_policy(tiny_dir)
    engine = CudaEngine.for_policy(policy, load_tokenizer(tiny_dir), cfg.rollout)
    assert engine.memory().cache == 0  # nothing allocated before the first call
    engine.generate(PROMPTS, greedy=True)
    mem = engine.memory()
    assert isinstance(mem, EngineMemory)
    w = engine.weights
    fused = sum(t.numel() for layer in w.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert mem.weights == 4 * (fused + w.cos.numel() + w.sin.numel())  # its own fused layers and rotary tables
    backbone = policy.lm.get_base_model().model
    assert w.embed.data_ptr() == backbone.embed_tokens.weight.data_ptr()  # frozen: shared, not copied
    spec = w.spec
    assert mem.cache == engine.cache.nbytes == 4 * 64 * spec.kv_bytes_per_token(torch.float32)


# ----------------------------------------------------------------------------- through a run
@pytest.fixture(scope="module")
def sevens(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "sevens.py"
    path.write_text("def sevens(prompt, response, **fields):\n    return response.count('7') / max(1, len(response))\n")
    return f"{path}:sevens"


@pytest.mark.parametrize(("mode", "targets", "iterations"), [("lora", WITH_HEAD, 10), ("full", "all-linear", 3)])
def test_a_run_with_the_cuda_engine_refreshes_it_after_every_update_and_learns(
    tiny_dir, tmp_path, sevens, monkeypatch, mode, targets, iterations
):
    """PPO through the loop with the CUDA engine (eager, on the CPU): after each update the
    source loads the learner's weights into the engine, so its log-probs are the scorer's
    (mismatch_kl ~ 0 every iteration; stale weights would show at once), and the reward rises."""
    from ppokit.lm.generation import factory
    from ppokit.persistence.rundir import read_metrics
    from ppokit.workloads import train

    built = []

    class Recorded(CudaEngine):
        @classmethod
        def for_policy(cls, *args, **options):
            built.append(super().for_policy(*args, **options))
            return built[-1]

    # the engine class make_engine picks, looked up when it is called (the workloads import make_engine itself)
    monkeypatch.setattr(factory, "engine_class", lambda kind: Recorded)
    cfg = build_config(
        [
            {
                "workload": "lm",
                "seed": 1,
                "model": {"path": str(tiny_dir), "mode": mode, "lora_target_modules": targets},
                "rollout": {"temperature": 1.0, "max_new_tokens": 8},
                "data": {"prompts": "arithmetic", "eval_size": 0, "reward": sevens},
                "train": {
                    "iterations": iterations,
                    "batch_size": 64,
                    "mini_batch_size": 32,
                    "micro_batch_size": 32,
                    "learning_rate": 2e-2 if mode == "lora" else 2e-3,
                    "critic_learning_rate": 1e-2,
                    "epochs": 2,
                    "grad_clip": 1.0,
                    "lr_warmup_ratio": 0.0,
                },
                "algo": {"gamma": 1.0, "gae_lambda": 0.95, "group_size": 4},
                "run": {"precision": "fp32", "progress": False, "tensorboard": False},
            }
        ]
    )
    train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(built) == 1 and isinstance(built[0], CudaEngine) and len(rows) == iterations
    for row in rows:
        assert row["mismatch_kl"] < 1e-8 and abs(row["mismatch_ratio_max"] - 1) < 1e-4, row
    if mode == "lora":  # learns as with the HF engine (tests/lm/test_rollout_engine_seam.py, the same run)
        rewards = [r["reward_mean"] for r in rows]
        first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
        assert first < 0.1 and last > 0.5, rewards


# ----------------------------------------------------------------------------- EOS
def test_rows_stop_at_their_first_eos(qwen_dir):
    tok = load_tokenizer(qwen_dir)
    model = plain_model(qwen_dir)
    free = CudaEngine.for_model(model, tok, config(qwen_dir).rollout).generate(PROMPTS, greedy=True)
    eos = int(free.responses[0, 2])  # a token row 0 generates third: make it the EOS
    engine = CudaEngine.for_model(model, tok, config(qwen_dir).rollout, eos_ids=[eos])
    batch = engine.generate(PROMPTS, greedy=True)
    hf = HFEngine.for_model(model, tok, config(qwen_dir).rollout, eos_ids=[eos]).generate(PROMPTS, greedy=True)
    assert torch.equal(batch.input_ids, hf.input_ids) and torch.equal(batch.mask, hf.mask)
    first = [(r == eos).nonzero()[0, 0].item() if (r == eos).any() else None for r in free.responses]
    for i, f in enumerate(first):
        if f is None:
            assert batch.truncated[i] and batch.mask[i].sum() == 12
        else:
            assert not batch.truncated[i] and batch.mask[i].sum() == f + 1
            assert batch.responses[i, f] == eos and (batch.responses[i, f + 1 :] == tok.pad_token_id).all()
            assert (batch.attention_mask[i, batch.prompt_length + f + 1 :] == 0).all()
    torch.manual_seed(0)
    sampled = engine.generate(PROMPTS * 4)
    assert (sampled.rollout_log_prob[sampled.mask == 0] == 0).all()


def test_generation_stops_when_every_row_has_ended(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    model = plain_model(tiny_dir)
    free = CudaEngine.for_model(model, tok, config(tiny_dir).rollout).generate(["7="], greedy=True)
    eos = int(free.responses[0, 0])  # the first token ends the response
    batch = CudaEngine.for_model(model, tok, config(tiny_dir).rollout, eos_ids=[eos]).generate(["7="], greedy=True)
    assert batch.responses.shape[1] == 1 and batch.mask.tolist() == [[1.0]] and not batch.truncated[0]


# ----------------------------------------------------------------------------- what it runs
def test_group_rows_share_one_prefill_and_sample_apart(tiny_dir):
    cfg, policy = lora_policy(tiny_dir, temperature=1.0)
    engine = CudaEngine.for_policy(policy, load_tokenizer(tiny_dir), cfg.rollout)
    greedy = engine.generate(PROMPTS[:2], group_size=3, greedy=True)
    assert torch.equal(greedy.responses[0], greedy.responses[2]) and torch.equal(
        greedy.group_ids, torch.tensor([0, 0, 0, 1, 1, 1])
    )
    torch.manual_seed(0)
    sampled = engine.generate(PROMPTS[:1], group_size=8)
    assert len({tuple(r.tolist()) for r in sampled.responses}) > 1


def test_models_it_does_not_run_fall_back_to_the_hf_engine_with_a_note(tiny_dir, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = load_tokenizer(tiny_dir)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert "model type 'gpt2'" in unsupported_reason(gpt2)
    engine = CudaEngine.for_model(gpt2, tok, config(tiny_dir).rollout)
    assert isinstance(engine, HFEngine)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ppokit: note: rollout.engine=cuda does not run model type 'gpt2'" in err
    assert unsupported_reason(plain_model(tiny_dir)) is None


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sliding_window_and_dora_are_refused(tiny_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    windowed = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            use_sliding_window=True,
            sliding_window=4,
        )
    )
    assert unsupported_reason(windowed) == "sliding-window attention"
    dora = get_peft_model(plain_model(tiny_dir), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True), "actor")
    assert unsupported_reason(dora, "actor") == "DoRA adapters"


# ----------------------------------------------------------------------------- CUDA graphs
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_decode_what_the_eager_loop_does(qwen_dir, dtype):
    cfg = config(qwen_dir, temperature=0.9)
    policy = build_policy(cfg, qwen_dir, device=torch.device("cuda"), autocast_dtype=dtype, seed=0)
    randomize(policy, std=0.3)
    tok = load_tokenizer(qwen_dir)
    graphed = CudaEngine.for_policy(policy, tok, cfg.rollout)
    eager = CudaEngine.for_policy(policy, tok, cfg.rollout, graphs=False)
    assert graphed.graphs and not eager.graphs
    for group_size in (1, 3):  # two batch buckets: two graphs in one pool
        a, b = (e.generate(PROMPTS, group_size=group_size, greedy=True) for e in (graphed, eager))
        assert torch.equal(a.input_ids, b.input_ids)
    torch.manual_seed(0)
    a = graphed.generate(PROMPTS, group_size=4)
    torch.manual_seed(0)
    b = eager.generate(PROMPTS, group_size=4)
    assert torch.equal(a.input_ids, b.input_ids)
    torch.testing.assert_close(a.rollout_log_prob, b.rollout_log_prob)
    if dtype == torch.float32:
        scored = policy.log_probs(a.tensors())["log_prob"] * a.mask
        torch.testing.assert_close(a.rollout_log_prob, scored, rtol=0, atol=1e-4)
    assert len(graphed.runners) == 3
