"""ppokit.monitoring.health: the run's warnings when PPO has nothing to learn from or its updates run away,
and the held-out check that compares greedy and sampled accuracy before PPO."""

from __future__ import annotations

import json

import pytest
import torch

from ppokit.cli import main
from ppokit.config import build_config, load_config
from ppokit.monitoring.health import CLIPFRAC_ALARM, KL_ALARM, NO_SIGNAL_ITERATIONS, RunHealth


def lm_config(**sections):
    return build_config([{"workload": "lm", "train": {"iterations": 10}, **sections}])


def test_no_reward_variance_in_the_first_iterations_is_said_once_with_what_to_change():
    health = RunHealth(lm_config(rollout={"temperature": 1.0, "max_new_tokens": 24}))
    flat = {"reward_std": 0.0, "reward_mean": 0.0, "truncated_frac": 0.62}
    assert NO_SIGNAL_ITERATIONS == 2
    assert health.check(0, flat) == []  # one iteration is not yet a pattern
    (line,) = health.check(1, flat)
    assert line.startswith("iterations 0-1: every sampled response got the same reward (0), so PPO has nothing")
    assert "rollout.temperature (now 1)" in line and "rollout.max_new_tokens (now 24): 62% of responses" in line
    assert "data.sft_epochs" in line and "\n" not in line
    assert health.check(2, flat) == []  # said once


@pytest.mark.parametrize(
    "rows",
    [
        [{"reward_std": 0.3}, {"reward_std": 0.0}, {"reward_std": 0.0}],  # a signal at the start
        [{"reward_std": 0.0}, {"reward_std": 0.1}, {"reward_std": 0.0}],
    ],
)
def test_a_run_that_had_a_signal_is_not_warned_later(rows):
    health = RunHealth(lm_config())
    assert [health.check(i, row) for i, row in enumerate(rows)] == [[], [], []]


def test_a_resumed_run_and_a_control_run_are_not_warned_about_rewards():
    health = RunHealth(lm_config())
    assert health.check(5, {"reward_std": 0.0}) == [] and health.check(6, {"reward_std": 0.0}) == []
    control = RunHealth(load_config("cartpole", []))
    assert [control.check(i, {"approx_kl": 0.01, "clipfrac": 0.2}) for i in range(3)] == [[], [], []]


def test_runaway_updates_are_said_once_with_the_learning_rate_of_the_mode():
    full = RunHealth(lm_config(model={"mode": "full"}, train={"iterations": 10, "learning_rate": 2e-3}))
    assert full.check(0, {"approx_kl": KL_ALARM / 2, "clipfrac": CLIPFRAC_ALARM / 2}) == []
    (line,) = full.check(1, {"approx_kl": 0.53, "clipfrac": 0.27})  # the arith preset in full mode
    assert line.startswith("iteration 1: the update moved the policy far beyond PPO's clip range (approx_kl 0.53")
    assert "lower train.learning_rate (now 0.002; full fine-tuning usually wants 1e-6 to 1e-5)" in line
    assert full.check(2, {"approx_kl": 0.9}) == []
    lora = RunHealth(lm_config(train={"iterations": 10, "epochs": 4}))
    (line,) = lora.check(0, {"approx_kl": 0.01, "clipfrac": 0.7})
    assert "clip fraction 0.70 (alarm above 0.5)" in line and "full fine-tuning" not in line
    assert "fewer train.epochs (now 4)" in line
    nan = RunHealth(lm_config())
    assert nan.check(0, {"approx_kl": float("nan"), "clipfrac": None}) == []


@pytest.mark.slow
def test_a_run_whose_rewards_never_differ_says_so(tmp_path, capsys):
    fn = tmp_path / "rewards.py"
    fn.write_text("def zero(prompt, response, **fields):\n    return 0.0\n")
    args = ["train", "arith", "data.sft_epochs=0", "train.iterations=2", "train.batch_size=16"]
    args += ["train.mini_batch_size=16", "data.eval_size=8", f"data.reward={fn}:zero", "rollout.max_new_tokens=4"]
    status = main([*args, f"run.output_dir={tmp_path}", "run.name=r", "--no-progress", "run.tensorboard=false"])
    out, err = capsys.readouterr()
    assert status == 0, err[-2000:]
    assert "iterations 0-1: every sampled response got the same reward (0), so PPO has nothing" in out
    # before PPO: neither greedy nor sampled responses score
    assert "held-out accuracy before PPO: 0.0% (8 prompts); sampled at temperature 1.5: 0.0%" in out
    assert "no held-out response earns a reward, greedy or sampled" in out
    row = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward_std"] == 0.0


class _Engine:
    """An engine whose greedy answers are right and whose sampled ones are right 1 time in 4."""

    device = torch.device("cpu")

    def generate(self, prompts, *, greedy=False, items=None, max_new_tokens=None, group_size=1):
        from types import SimpleNamespace

        if greedy:
            texts = [it["answer"] for it in items]
        else:
            draws = torch.rand(len(prompts))  # the global generator, as the engines sample
            texts = [it["answer"] if d < 0.25 else "?" for it, d in zip(items, draws)]
        return SimpleNamespace(texts=texts)


def test_the_check_before_ppo_compares_greedy_and_sampled_without_touching_the_run_s_random_stream():
    from ppokit.lm.single_turn.evaluator import LMEvaluator

    items = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(400)]
    evaluator = LMEvaluator(lm_config(rollout={"temperature": 1.0}), _Engine(), items, "exact_match")
    state = torch.get_rng_state()
    metrics = evaluator.evaluate("before")
    assert torch.equal(torch.get_rng_state(), state)  # rollouts draw the same with or without the check
    assert metrics["eval_accuracy_before"] == 1.0 and 0.18 < metrics["eval_sampled_accuracy_before"] < 0.32
    again = LMEvaluator(lm_config(rollout={"temperature": 1.0}), _Engine(), items, "exact_match").evaluate("before")
    assert again == metrics  # its own seeded stream
    line = evaluator.message("before", metrics)
    first, hint = line.split("\n")
    assert first.startswith("held-out accuracy before PPO: 100.0% (400 prompts); sampled at temperature 1: ")
    assert hint.startswith("sampled responses score ") and "lower rollout.temperature (now 1;" in hint
    fine = evaluator.message("before", {"eval_accuracy_before": 0.4, "eval_sampled_accuracy_before": 0.3})
    assert "\n" not in fine
    assert evaluator.message("periodic", {"eval_accuracy": 0.5}) is None
