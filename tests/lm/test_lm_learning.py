"""End to end: ``train_lm`` on the tiny model raises the reward; the other loss settings run."""

from __future__ import annotations

import json

import pytest
import torch

from ppokit.config import build_config
from ppokit.persistence.rundir import read_metrics

# LoRA on lm_head too: the random tiny model's lm_head has small weights after a norm,
# so without it the logits cannot move far enough to make one token likely.
ALL_LINEAR_AND_HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return tiny_model_dir  # tests/lm/conftest.py: a random tiny Llama + char tokenizer


@pytest.fixture(scope="module")
def sevens(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "sevens.py"
    path.write_text("def sevens(prompt, response, **fields):\n    return response.count('7') / max(1, len(response))\n")
    return f"{path}:sevens"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # train_lm picks one thread for a small model


def config(tiny_dir, tmp_path, **sections):
    base = {
        "workload": "lm",
        "seed": 1,
        "model": {"path": str(tiny_dir), "lora_target_modules": ALL_LINEAR_AND_HEAD},
        "rollout": {"temperature": 1.0, "max_new_tokens": 8},
        "data": {"prompts": "arithmetic", "eval_size": 32},
        "train": {
            "iterations": 12,
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
        "algo": {"gamma": 1.0, "gae_lambda": 0.95, "group_size": 4},
        "run": {
            "precision": "fp32",
            "progress": False,
            "tensorboard": False,
            "output_dir": str(tmp_path),
            "name": "run",
        },
    }
    return build_config([base, sections])


def test_ppo_raises_the_reward(tiny_dir, tmp_path, sevens):
    from ppokit.workloads import train as train_lm

    cfg = config(tiny_dir, tmp_path, data={"reward": sevens})
    result = train_lm(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == cfg.train.iterations
    rewards = [r["reward_mean"] for r in rows]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    # A random model writes a '7' about once in 56 characters.
    assert first < 0.1 and last > 0.5 and last > first + 0.4, rewards
    assert result["eval_accuracy_before"] < 0.1 and result["eval_accuracy_after"] > 0.5, result
    for key in (
        "kl_ref",
        "approx_kl",
        "clipfrac",
        "entropy",
        "value_loss",
        "explained_variance",
        "response_length",
        "reward_std",
        "gen_tokens_per_s",
        "train_tokens_per_s",
    ):
        assert key in rows[-1], key
    for phase in ("generate", "collect", "score", "update"):  # each phase's peak memory, every iteration
        assert all(0.01 < row[f"memory/peak_gb/{phase}"] < 100 for row in rows), phase
    assert all(row["memory/peak_gb"] >= row["memory/peak_gb/collect"] >= row["memory/peak_gb/generate"] for row in rows)
    assert rows[-1]["kl_ref"] > rows[0]["kl_ref"]  # it moved away from the reference
    # Two epochs: the scorer's log-probs are used, and checked against the update's first
    # forward. The same kernels on a CPU: equal. A GPU picks kernels by batch shape (the
    # scorer's chunks of 64 against the update's 32): within 1e-4 (3.8e-6 on an H100).
    gap_limit = 1e-4 if torch.cuda.is_available() else 0.0
    assert rows[-1]["old_log_prob_gap"] <= gap_limit


def test_a_fully_on_policy_run_takes_its_old_log_probs_from_the_update(tiny_dir, tmp_path, sevens, monkeypatch):
    from ppokit.lm import learner
    from ppokit.workloads import train as train_lm

    built = []
    scorer_class = learner.Scorer
    monkeypatch.setattr(learner, "Scorer", lambda *a, **kw: built.append(kw) or scorer_class(*a, **kw))
    cfg = config(
        tiny_dir,
        tmp_path,
        data={"reward": sevens, "eval_size": 0},
        train={"iterations": 3, "batch_size": 16, "mini_batch_size": 16, "micro_batch_size": 8, "epochs": 1},
    )
    train_lm(cfg, tmp_path / "run")
    assert built[0]["need_old_log_prob"] is False
    rows = read_metrics(tmp_path / "run")
    assert all("old_log_prob_gap" not in r for r in rows)
    assert all(r["clipfrac"] == 0.0 for r in rows)  # one step: every ratio is 1
    # kl_ref from the update's own log-probs: 0 before the first step, then growing
    assert rows[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6) and rows[-1]["kl_ref"] > 1e-4


def test_kl_metric_rows_sizes_the_reference_pass_and_0_skips_it(tiny_dir, tmp_path, sevens, monkeypatch):
    from ppokit.lm import learner
    from ppokit.workloads import train as train_lm

    built = []
    scorer_class = learner.Scorer
    monkeypatch.setattr(learner, "Scorer", lambda *a, **kw: built.append(kw) or scorer_class(*a, **kw))
    for rows_measured in (5, 0):
        cfg = config(
            tiny_dir,
            tmp_path,
            data={"reward": sevens, "eval_size": 0},
            train={"iterations": 1},
            algo={"kl_metric_rows": rows_measured},
        )
        train_lm(cfg, tmp_path / f"run{rows_measured}")
        assert built[-1]["metric_rows"] == rows_measured
        assert ("kl_ref" in read_metrics(tmp_path / f"run{rows_measured}")[0]) == (rows_measured > 0)


def test_group_estimator_with_adaptive_kl_in_reward(tiny_dir, tmp_path, sevens):
    from ppokit.workloads import train as train_lm

    cfg = config(
        tiny_dir,
        tmp_path,
        data={"reward": sevens, "eval_size": 0},
        train={"iterations": 3, "batch_size": 16, "mini_batch_size": 16, "micro_batch_size": 8},
        algo={
            "adv_estimator": "grpo",
            "use_kl_in_reward": True,
            "kl_penalty": "low_var_kl",
            "kl_ctrl": {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.01, "horizon": 100},
        },
    )
    train_lm(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    # verl's rule on verl's input (reward_kl: each sequence's mean KL per token, averaged):
    # coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon, with n = 16 sequences
    coef = 0.05
    for row in rows:
        assert row["kl_coef"] == pytest.approx(coef, rel=1e-12)
        coef *= 1 + min(max(row["reward_kl"] / 0.01 - 1, -0.2), 0.2) * 16 / 100
    assert rows[0]["reward_kl"] == 0.0  # LoRA's B starts at 0: the actor is the reference
    assert rows[1]["kl_coef"] < 0.05  # below target: it shrank...
    assert all(r["reward_kl"] > 0.01 for r in rows[1:]) and rows[2]["kl_coef"] > rows[1]["kl_coef"]  # ...above: grew
    assert not {"value_loss", "explained_variance"} & set(rows[-1])  # GRPO trains no critic


def test_full_mode_with_kl_loss(tiny_dir, tmp_path, sevens):
    from ppokit.workloads import train as train_lm

    cfg = config(
        tiny_dir,
        tmp_path,
        model={"mode": "full"},
        data={"reward": sevens, "eval_size": 4},
        train={
            "iterations": 2,
            "batch_size": 8,
            "mini_batch_size": 8,
            "micro_batch_size": 4,
            "learning_rate": 1e-3,
            "epochs": 1,
        },
        algo={"beta": 0.1, "kl_loss_type": "low_var_kl"},
    )
    result = train_lm(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    # the frozen reference copy is the actor before its first step: KL 0 (to the rounding of
    # the scorer's and the update's batch shapes), then not
    assert rows[0]["kl_loss"] < 1e-10 and abs(rows[0]["kl_ref"]) < 1e-5
    assert rows[-1]["kl_loss"] > 0 and rows[-1]["kl_ref"] != 0
    meta = json.loads((tmp_path / "run" / "checkpoint" / "policy.json").read_text())
    assert meta["mode"] == "full" and "eval_accuracy_after" in result


@pytest.mark.parametrize(
    "algo_settings",
    [
        {"adv_estimator": "grpo"},
        {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": False},
        {"adv_estimator": "grpo", "scale_rewards": "batch"},
        {"adv_estimator": "rloo"},
        {"adv_estimator": "reinforce_pp"},
        {"adv_estimator": "reinforce_pp_baseline"},
        {
            "adv_estimator": "grpo",
            "ratio_level": "gspo",
            "lower_clip_ratio": 3e-4,
            "upper_clip_ratio": 4e-4,
            "loss_agg_mode": "seq-mean-token-mean",
        },
    ],
    ids=["grpo", "dr_grpo", "grpo_batch_std", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo"],
)
def test_critic_free_estimators_raise_the_reward(tiny_dir, tmp_path, sevens, algo_settings):
    """Each critic-free estimator takes a random tiny model from about 2% sevens to most of
    its characters being 7 in 12 iterations of 64 sequences (seed 1; measured: 0.9-1.0)."""
    from ppokit.workloads import train as train_lm

    cfg = config(tiny_dir, tmp_path, data={"reward": sevens, "eval_size": 0}, algo=algo_settings)
    train_lm(cfg, tmp_path / "run")
    rewards = [r["reward_mean"] for r in read_metrics(tmp_path / "run")]
    assert rewards[0] < 0.1 and sum(rewards[-2:]) / 2 > 0.8, rewards


def test_ppo_penalty_raises_the_reward(tiny_dir, tmp_path, sevens):
    """loss_mode=penalty (no clipping, the adaptive KL(old || new) coefficient) learns too,
    more slowly: the coefficient holds each update near penalty_target_kl."""
    from ppokit.workloads import train as train_lm

    cfg = config(tiny_dir, tmp_path, data={"reward": sevens, "eval_size": 0}, algo={"loss_mode": "penalty"})
    train_lm(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    rewards = [r["reward_mean"] for r in rows]
    assert rewards[0] < 0.1 and sum(rewards[-2:]) / 2 > rewards[0] + 0.2, rewards
    assert all(r["clipfrac"] == 0.0 and "kl_old" in r for r in rows)
    coefs = [r["penalty_coef"] for r in rows]
    assert coefs[0] == 1.0 and all(b / a in (0.5, 1.0, 2.0) for a, b in zip(coefs, coefs[1:]))
