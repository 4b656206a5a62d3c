"""End to end: ``train_lm`` on the tiny model raises the reward; the other loss settings run."""

from __future__ import annotations

import json

import pytest
import torch

from ppokit.config import build_config
from ppokit.rundir import read_metrics

# LoRA on lm_head too: the random tiny model's lm_head has small weights after a norm,
# so without it the logits cannot move far enough to make one token likely.
ALL_LINEAR_AND_HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return tiny_model_dir          # tests/lm/conftest.py: a random tiny Llama + char tokenizer


@pytest.fixture(scope="module")
def sevens(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "sevens.py"
    path.write_text("def sevens(prompt, response, **fields):\n"
                    "    return response.count('7') / max(1, len(response))\n")
    return f"{path}:sevens"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)     # train_lm picks one thread for a small model


def config(tiny_dir, tmp_path, **sections):
    base = {"workload": "lm", "seed": 1,
            "model": {"path": str(tiny_dir), "lora_target_modules": ALL_LINEAR_AND_HEAD},
            "rollout": {"temperature": 1.0, "max_new_tokens": 8},
            "data": {"prompts": "arithmetic", "eval_size": 32},
            "train": {"iterations": 12, "batch_size": 64, "mini_batch_size": 32, "micro_batch_size": 32,
                      "infer_micro_batch_size": 64, "learning_rate": 2e-2, "critic_learning_rate": 1e-2,
                      "epochs": 2, "grad_clip": 1.0, "lr_warmup_ratio": 0.0},
            "algo": {"gamma": 1.0, "gae_lambda": 0.95, "group_size": 4},
            "run": {"precision": "fp32", "progress": False, "tensorboard": False, "output_dir": str(tmp_path),
                    "name": "run"}}
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
    for key in ("kl_ref", "approx_kl", "clipfrac", "entropy", "value_loss", "explained_variance",
                "response_length", "reward_std", "gen_tokens_per_s", "train_tokens_per_s"):
        assert key in rows[-1], key
    assert rows[-1]["kl_ref"] > rows[0]["kl_ref"]        # it moved away from the reference
    # Two epochs: the scorer's log-probs are used, and checked against the update's first
    # forward. The same kernels on a CPU: equal. A GPU picks kernels by batch shape (the
    # scorer's chunks of 64 against the update's 32): within 1e-4 (3.8e-6 on an H100).
    gap_limit = 1e-4 if torch.cuda.is_available() else 0.0
    assert rows[-1]["old_log_prob_gap"] <= gap_limit


def test_a_fully_on_policy_run_takes_its_old_log_probs_from_the_update(tiny_dir, tmp_path, sevens, monkeypatch):
    from ppokit.lm import workload
    from ppokit.workloads import train as train_lm

    built = []
    scorer_class = workload.Scorer
    monkeypatch.setattr(workload, "Scorer", lambda *a, **kw: built.append(kw) or scorer_class(*a, **kw))
    cfg = config(tiny_dir, tmp_path, data={"reward": sevens, "eval_size": 0},
                 train={"iterations": 3, "batch_size": 16, "mini_batch_size": 16, "micro_batch_size": 8,
                        "epochs": 1})
    train_lm(cfg, tmp_path / "run")
    assert built[0]["need_old_log_prob"] is False
    rows = read_metrics(tmp_path / "run")
    assert all("old_log_prob_gap" not in r for r in rows)
    assert all(r["clipfrac"] == 0.0 for r in rows)            # one step: every ratio is 1
    # kl_ref from the update's own log-probs: 0 before the first step, then growing
    assert rows[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6) and rows[-1]["kl_ref"] > 1e-4


def test_group_estimator_with_adaptive_kl_in_reward(tiny_dir, tmp_path, sevens):
    from ppokit.workloads import train as train_lm

    cfg = config(tiny_dir, tmp_path, data={"reward": sevens, "eval_size": 0},
                 train={"iterations": 3, "batch_size": 16, "mini_batch_size": 16, "micro_batch_size": 8},
                 algo={"adv_estimator": "grpo", "use_kl_in_reward": True, "kl_penalty": "low_var_kl",
                       "kl_ctrl": {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.01, "horizon": 100}})
    train_lm(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert [r["kl_coef"] for r in rows][0] == 0.05
    assert rows[-1]["kl_coef"] != 0.05                      # the controller reacted
    assert not {"value_loss", "explained_variance"} & set(rows[-1])   # GRPO trains no critic


def test_full_mode_with_kl_loss(tiny_dir, tmp_path, sevens):
    from ppokit.workloads import train as train_lm

    cfg = config(tiny_dir, tmp_path, model={"mode": "full"}, data={"reward": sevens, "eval_size": 4},
                 train={"iterations": 2, "batch_size": 8, "mini_batch_size": 8, "micro_batch_size": 4,
                        "learning_rate": 1e-3},
                 algo={"beta": 0.1, "kl_loss_type": "low_var_kl"})
    result = train_lm(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert "kl_loss" in rows[-1] and rows[-1]["kl_loss"] > 0
    meta = json.loads((tmp_path / "run" / "checkpoint" / "policy.json").read_text())
    assert meta["mode"] == "full" and "eval_accuracy_after" in result
