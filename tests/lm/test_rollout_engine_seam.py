"""The rollout-engine seam: the HF engine's behaviour log-probs, the factory, and rollout correction
through a whole run with an engine whose log-probs are deliberately off."""

from __future__ import annotations

import math

import pytest
import torch
from lm_helpers import randomize

from ppokit import algo
from ppokit.config import build_config
from ppokit.errors import UserError
from ppokit.lm.generation import factory
from ppokit.lm.generation.base import EngineMemory, RolloutEngine, sampling_log_probs
from ppokit.lm.generation.engine import HFEngine, assemble
from ppokit.lm.generation.factory import engine_kind, make_engine
from ppokit.lm.model.hf import load_tokenizer
from ppokit.lm.model.policy import build_policy
from ppokit.lm.scoring import Scorer
from ppokit.persistence.rundir import read_metrics
from ppokit.trainer import PPOTrainer

CPU = torch.device("cpu")
PROMPTS = ["12+3=", "7+88=", "1=", "99+99="]
ALL_LINEAR_AND_HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def lm_config(tiny_dir, **rollout):
    return build_config(
        [
            {
                "workload": "lm",
                "model": {"path": str(tiny_dir)},
                "rollout": {"max_new_tokens": 8, "micro_batch_size": 5, **rollout},
                "train": {"iterations": 1, "batch_size": 8},
                "run": {"precision": "fp32", "progress": False, "tensorboard": False},
            }
        ]
    )


def random_policy(tiny_dir, cfg):
    policy = build_policy(cfg, tiny_dir, device=CPU, autocast_dtype=None)
    randomize(policy)
    return policy


# ----------------------------------------------------------------------------- the sampled distribution
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.3, 5, 1.0), (0.8, 0, 0.7), (0.6, 7, 0.9)])
def test_sampling_log_probs_are_the_warped_distribution(temperature, top_k, top_p):
    """Against a float64 sort written out: temperature, then the top k, then the smallest nucleus
    holding top_p of what is left (a token whose cumulative mass, smallest first, exceeds 1 - top_p)."""
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(4, 30, generator=g, dtype=torch.float64)
    got = sampling_log_probs(logits, temperature, top_k, top_p)
    for row, out in zip(logits, got):
        z = row / temperature
        if top_k:
            z = torch.where(z >= torch.sort(z, descending=True).values[top_k - 1], z, -torch.inf)
        if top_p < 1:
            values, order = torch.sort(z)  # ascending
            cumulative = torch.softmax(values, -1).cumsum(-1)
            drop = cumulative <= 1 - top_p
            drop[-1] = False
            z = z.clone()
            z[order[drop]] = -torch.inf
        want = torch.log_softmax(z, -1)
        assert torch.equal(torch.isinf(out), torch.isinf(want))
        finite = ~torch.isinf(want)
        torch.testing.assert_close(out[finite].double(), want[finite], rtol=1e-5, atol=1e-6)
        assert math.isclose(float(out.exp().sum()), 1.0, rel_tol=1e-5)


def test_the_hf_engine_records_the_log_probs_it_sampled_from(tiny_dir):
    """Temperature only: the scorer's old log-probs (same fp32 weights) within 1e-5; with top-k the
    engine's log-probs are those of the truncated distribution, which gives each kept token more."""
    tok = load_tokenizer(tiny_dir)
    cfg = lm_config(tiny_dir, temperature=0.7)
    policy = random_policy(tiny_dir, cfg)
    torch.manual_seed(0)
    engine = make_engine(policy, tok, cfg.rollout)
    assert isinstance(engine, RolloutEngine) and isinstance(engine, HFEngine) and engine.name == "hf"
    ro = engine.generate(PROMPTS, group_size=3)
    scored = Scorer(policy, 5, need_reference=False).forward_passes(ro.tensors())
    assert ro.rollout_log_prob.shape == ro.mask.shape and ro.rollout_log_prob.dtype == torch.float32
    torch.testing.assert_close(ro.rollout_log_prob, scored["old_log_prob"], rtol=0, atol=1e-5)
    assert torch.equal(ro.rollout_log_prob * (1 - ro.mask), torch.zeros_like(ro.mask))  # 0 on padding
    assert (ro.rollout_log_prob[ro.mask.bool()] < 0).all()

    cfg_k = lm_config(tiny_dir, temperature=1.5, top_k=3)
    torch.manual_seed(1)
    ro_k = make_engine(policy, tok, cfg_k.rollout).generate(PROMPTS, group_size=3)
    policy.temperature = 1.5
    full = Scorer(policy, 5, need_reference=False).forward_passes(ro_k.tensors())["old_log_prob"]
    valid = ro_k.mask.bool()
    assert (ro_k.rollout_log_prob[valid] >= full[valid] - 1e-5).all()  # renormalised over 3 tokens
    assert float((ro_k.rollout_log_prob - full)[valid].mean()) > 0.05
    # greedy: no distribution sampled, no behaviour log-probs
    assert make_engine(policy, tok, cfg.rollout).generate(PROMPTS, greedy=True).rollout_log_prob is None


def test_top_k_log_probs_match_the_warpers_on_the_models_logits(tiny_dir):
    """With one prompt and one token the logits are known: the engine's log-prob of what it sampled
    is sampling_log_probs of the model's next-token logits."""
    tok = load_tokenizer(tiny_dir)
    cfg = lm_config(tiny_dir, temperature=1.2, top_k=4, top_p=0.8, max_new_tokens=1)
    policy = random_policy(tiny_dir, cfg)
    torch.manual_seed(3)
    ro = make_engine(policy, tok, cfg.rollout).generate(["5+5="], group_size=16)
    enc = tok(["5+5="], return_tensors="pt")
    with torch.no_grad(), policy.use("actor"):
        logits = policy.lm(**enc).logits[0, -1]  # (V,)
    dist = sampling_log_probs(logits[None], 1.2, 4, 0.8)[0]
    want = dist[ro.responses[:, 0]]
    torch.testing.assert_close(ro.rollout_log_prob[:, 0], want, rtol=0, atol=1e-5)
    assert torch.isfinite(want).all()  # every sampled token is inside the nucleus


def test_a_models_own_min_p_does_not_cut_the_distribution_after_the_recorder(tiny_dir):
    """transformers would run a generation_config's min_p after the recording processor: the engine
    turns it off, so tokens below min_p * the top probability are still sampled, as recorded."""
    tok = load_tokenizer(tiny_dir)
    cfg = lm_config(tiny_dir, temperature=0.2, max_new_tokens=1)
    policy = random_policy(tiny_dir, cfg)
    engine = make_engine(policy, tok, cfg.rollout)
    engine.model.generation_config.min_p = 0.5
    torch.manual_seed(0)
    ro = engine.generate(["5+5="], group_size=64)
    enc = tok(["5+5="], return_tensors="pt")
    with torch.no_grad(), policy.use("actor"):
        dist = sampling_log_probs(policy.lm(**enc).logits[0, -1][None], 0.2)[0]  # (V,)
    below = dist < dist.max() + math.log(0.5)  # what min_p=0.5 would cut
    assert float(dist[below].exp().sum()) > 0.2  # enough mass there for 64 samples to reach it
    torch.testing.assert_close(ro.rollout_log_prob[:, 0], dist[ro.responses[:, 0]], rtol=0, atol=1e-5)
    assert below[ro.responses[:, 0]].any()


def test_the_engine_samples_what_transformers_samples(tiny_dir):
    """The warpers moved into the recording processor change nothing: with one seed, the HF engine's
    samples are those of ``generate`` with transformers' own temperature / top-k / top-p."""
    from transformers import GenerationConfig

    tok = load_tokenizer(tiny_dir)
    cfg = lm_config(tiny_dir, temperature=0.7, top_k=10, top_p=0.9, max_new_tokens=6, micro_batch_size=64)
    policy = random_policy(tiny_dir, cfg)
    engine = make_engine(policy, tok, cfg.rollout)
    torch.manual_seed(5)
    ro = engine.generate(PROMPTS, group_size=4)
    enc = tok(PROMPTS, padding=True, return_tensors="pt")
    plain = GenerationConfig(
        max_new_tokens=6,
        do_sample=True,
        temperature=0.7,
        top_k=10,
        top_p=0.9,
        eos_token_id=engine.eos_ids,
        pad_token_id=engine.pad_id,
    )
    torch.manual_seed(5)
    with torch.no_grad(), policy.use("actor"):
        out = engine.model.generate(
            input_ids=enc["input_ids"].repeat_interleave(4, 0),
            attention_mask=enc["attention_mask"].repeat_interleave(4, 0),
            generation_config=plain,
        )
    ids = enc["input_ids"].repeat_interleave(4, 0)
    same_layout = assemble(
        ids, torch.ones_like(ids), out[:, ids.shape[1] :], eos_ids=engine.eos_ids, pad_id=engine.pad_id
    )
    assert torch.equal(ro.responses, same_layout["responses"])


def test_the_factory_chooses_by_config_and_device():
    assert engine_kind("auto", "cpu") == "hf" and engine_kind("hf", "cpu") == "hf"
    with pytest.raises(UserError, match="rollout.engine=cuda needs a CUDA device, but the run is on cpu"):
        engine_kind("cuda", "cpu")
    assert engine_kind("auto", "cuda") == factory.AUTO_ON_CUDA and engine_kind("cuda", "cuda") == "cuda"


def test_the_hf_engine_loads_rollout_weights_and_reports_no_memory_of_its_own(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    cfg = lm_config(tiny_dir)
    policy, other = random_policy(tiny_dir, cfg), random_policy(tiny_dir, cfg)
    from ppokit.lm.single_turn.workload import LMLearner

    engine = make_engine(other, tok, cfg.rollout)
    engine.load_weights(LMLearner(cfg, policy, tok, tiny_dir).rollout_weights())
    torch.manual_seed(0)
    a = make_engine(policy, tok, cfg.rollout).generate(PROMPTS, group_size=2)
    torch.manual_seed(0)
    b = engine.generate(PROMPTS, group_size=2)
    assert torch.equal(a.responses, b.responses)
    torch.testing.assert_close(a.rollout_log_prob, b.rollout_log_prob)
    assert engine.memory() == EngineMemory() and engine.memory().metrics() == {
        "engine/weights_gb": 0.0,
        "engine/cache_gb": 0.0,
    }


# ----------------------------------------------------------------------------- a perturbed engine in a run
SHIFT = 0.3  # the perturbed engine reports log pi - SHIFT on even rows: r = pi_old / pi_engine = e^0.3 there


class ShiftedEngine(HFEngine):
    """The HF engine, with its behaviour log-probs lowered by SHIFT on every even row."""

    def _generate(self, *args, **kwargs):
        batch = super()._generate(*args, **kwargs)
        if batch.rollout_log_prob is not None:
            even = torch.arange(len(batch)) % 2 == 0
            batch.rollout_log_prob[even] -= SHIFT * batch.mask[even]
        return batch


@pytest.fixture(scope="module")
def sevens(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "sevens.py"
    path.write_text("def sevens(prompt, response, **fields):\n    return response.count('7') / max(1, len(response))\n")
    return f"{path}:sevens"


def run_config(tiny_dir, tmp_path, sevens, iterations, **algo_fields):
    return build_config(
        [
            {
                "workload": "lm",
                "seed": 1,
                "model": {"path": str(tiny_dir), "lora_target_modules": ALL_LINEAR_AND_HEAD},
                "rollout": {"temperature": 1.0, "max_new_tokens": 8},
                "data": {"prompts": "arithmetic", "eval_size": 0, "reward": sevens},
                "train": {
                    "iterations": iterations,
                    "batch_size": 64,
                    "mini_batch_size": 32,
                    "micro_batch_size": 32,
                    "infer_micro_batch_size": 64,
                    "learning_rate": 2e-2,
                    "critic_learning_rate": 1e-2,
                    "epochs": 2,
                    "grad_clip": 1.0,
                    "lr_warmup_ratio": 0.0,
                },
                "algo": {"gamma": 1.0, "gae_lambda": 0.95, "group_size": 4, **algo_fields},
                "run": {
                    "precision": "fp32",
                    "progress": False,
                    "tensorboard": False,
                    "output_dir": str(tmp_path),
                    "name": "run",
                },
            }
        ]
    )


SPIED = ("old_log_prob", "rollout_log_prob", "mask", "correction_weight", "correction_keep")


def spy_corrections(monkeypatch):
    """Every batch's (old_log_prob, rollout_log_prob, mask, weight, keep) as the trainer corrected it."""
    seen = []
    real = PPOTrainer._rollout_correction

    def spy(self, batch):
        out, metrics = real(self, batch)
        seen.append({k: out[k].clone() for k in out if k in SPIED})
        return out, metrics

    monkeypatch.setattr(PPOTrainer, "_rollout_correction", spy)
    monkeypatch.setattr(factory, "engine_class", lambda kind: ShiftedEngine)
    return seen


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_a_perturbed_engine_is_corrected_as_the_formula_says_and_learning_works(
    tiny_dir, tmp_path, sevens, monkeypatch, mode
):
    from ppokit.workloads import train

    seen = spy_corrections(monkeypatch)
    iterations = 12 if mode == "tis" else 3
    cfg = run_config(tiny_dir, tmp_path, sevens, iterations, rollout_correction=mode, rollout_correction_cap=1.2)
    train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(seen) == iterations == len(rows)
    for batch, row in zip(seen, rows):
        mask = batch["mask"].bool()
        log_r = (batch["old_log_prob"] - batch["rollout_log_prob"]).double()
        even = (torch.arange(mask.shape[0]) % 2 == 0)[:, None].expand_as(mask)
        # the scorer and the unperturbed engine compute one distribution (fp32, one CPU): r is e^SHIFT or 1
        torch.testing.assert_close(log_r[mask & even], torch.full_like(log_r[mask & even], SHIFT), atol=2e-5, rtol=0)
        torch.testing.assert_close(log_r[mask & ~even], torch.zeros_like(log_r[mask & ~even]), atol=2e-5, rtol=0)
        weight, keep = algo.rollout_correction(
            batch["old_log_prob"].double(), batch["rollout_log_prob"].double(), batch["mask"], mode=mode, cap=1.2
        )[:2]
        torch.testing.assert_close(batch["correction_weight"].double(), weight, rtol=1e-6, atol=0)
        torch.testing.assert_close(batch["correction_keep"].double(), keep, rtol=0, atol=0)
        if mode == "tis":  # e^0.3 = 1.35 is capped at 1.2; the other rows weigh 1
            assert torch.allclose(batch["correction_weight"][mask & even], torch.tensor(1.2))
            assert row["correction_truncated_frac"] == pytest.approx(float(even[mask].float().mean()), abs=1e-6)
        else:  # e^0.3 leaves [1/1.2, 1.2]: the even rows are dropped
            assert float(batch["correction_keep"][mask & even].sum()) == 0.0
            assert row["correction_masked_frac"] == pytest.approx(float(even[mask].float().mean()), abs=1e-6)
        assert row["mismatch_ratio_max"] == pytest.approx(math.exp(SHIFT), rel=1e-4)
        assert row["mismatch_ratio_min"] == pytest.approx(1.0, abs=1e-4)
        k3 = math.exp(SHIFT) - 1 - SHIFT  # on the even rows' tokens, 0 on the others
        assert row["mismatch_kl"] == pytest.approx(k3 * float(even[mask].float().mean()), rel=1e-3)
    if mode == "tis":  # learning still works (the uncorrected run: tests/lm/test_lm_learning.py)
        rewards = [r["reward_mean"] for r in rows]
        first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
        assert first < 0.1 and last > 0.5 and last > first + 0.4, rewards


class OwnWeightsEngine:
    """An engine that keeps its own copy of the weights: it records what it is given."""

    weights_shared = False

    def __init__(self):
        self.loaded = []

    def load_weights(self, weights):
        self.loaded.append(weights)


class FakeLearner:
    policy_version = 3

    def rollout_weights(self):
        return {"w": torch.ones(1)}


def test_both_sources_give_an_engine_with_its_own_weights_the_learners_after_each_update(tiny_dir):
    from ppokit.lm.multi_turn.source import MultiTurnSource
    from ppokit.lm.single_turn.workload import LMSource

    cfg = lm_config(tiny_dir)
    for engine_holder in ("single", "multi"):
        engine = OwnWeightsEngine()
        if engine_holder == "single":
            source = LMSource(cfg, engine, None, None, CPU)
        else:
            source = MultiTurnSource(cfg, None, mode="state", pad_id=0, device=CPU, engine=engine)
        source.sync_weights(FakeLearner())
        source.sync_weights(FakeLearner())
        assert [w["w"].item() for w in engine.loaded] == [1.0, 1.0], engine_holder
    shared = make_engine(random_policy(tiny_dir, cfg), load_tokenizer(tiny_dir), cfg.rollout)
    assert shared.weights_shared  # the HF engine samples with the learner's own modules: nothing to copy
