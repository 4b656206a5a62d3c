"""Multi-turn PPO learns a game: a FrozenLake corridor, warm start on random legal moves, then PPO.

The lake (S start, F ice, H hole, G goal), moves answered with one letter::

    SFFG
    HHHH

Random legal play (l, d, r, u) reaches the goal in 5% of the episodes within 6 moves:
three "r" before any "d". Only the last move is rewarded, so the earlier ones learn
through the credit across turns (by turn, or by token). Seeded, on the small test
model; the assertions leave room for noise: PPO must lift the sampled success far
above the warm start's, and the greedy policy must reach the goal.

Another device samples another random stream (CUDA's generator, other rounding), so the
run must pass for most streams, not for one seed's. Measured on the CPU over 16 streams
(seeds 0-12 with token credit, 0, 1 and 3 with turn credit; two torch threads reproduce
one thread's curves exactly): the sampled success first passes 0.8 after 4 to 9
iterations, and once it has saturated an update now and then (whitened advantages of
near-equal returns are mostly noise) costs one iteration a dip, to 0.28 and 0.69 in 2 of
the 16 runs, that the next iteration repairs. The former criterion (10 iterations, the
mean of the last three above 0.8) failed seed 7 here and an H200 run (0.66); hence 14
iterations and the median of the last three. On a CPU with AVX2 only (fp32 kernels that round
otherwise) seed 2 with token credit then lost its stop token in the last iteration (approx_kl 1.66
in one update of near-equal returns: every move illegal, greedy success 0), so the critic runs
train at 2e-3, not 3e-3: there, seeds 0-7 with either credit all pass (16 runs), the sampled
success passes 0.8 after 5 to 11 iterations, and 3 of the 16 runs have one collapsed iteration
(approx_kl 0.59-0.76) that the next one repairs.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from ppokit.config import build_config
from ppokit.persistence.rundir import read_metrics
from ppokit.workloads import train


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


ALL_LINEAR_AND_HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def lake_config(tiny_dir, tmp_path, credit, **more):
    return build_config(
        [
            {
                "workload": "lm",
                "seed": 2,
                # LoRA on lm_head too: on the small test model the other adapters alone move the logits slowly
                "model": {"path": str(tiny_dir), "lora_target_modules": ALL_LINEAR_AND_HEAD},
                "data": {"sft_epochs": 12, "sft_examples": 300, "sft_learning_rate": 3e-3},
                "textenv": {
                    "env": "frozenlake",
                    "kwargs": {"desc": ["SFFG", "HHHH"], "max_steps": 6, "letters": True},
                    "max_turns": 6,
                    "eval_episodes": 8,
                    "eval_every": 0,
                },
                "rollout": {"temperature": 1.0, "max_new_tokens": 2},
                "train": {
                    "iterations": 14,
                    "batch_size": 64,
                    "mini_batch_size": 32,
                    "micro_batch_size": 256,
                    "infer_micro_batch_size": 256,
                    "epochs": 2,
                    "learning_rate": 2e-3,
                    "critic_learning_rate": 5e-3,
                    "grad_clip": 1.0,
                    "lr_warmup_ratio": 0.0,
                },
                "algo": {"gamma": 0.9, "gae_lambda": 1.0, "credit": credit},
                "run": {
                    "precision": "fp32",
                    "progress": False,
                    "tensorboard": False,
                    "output_dir": str(tmp_path),
                    "name": "run",
                },
            },
            more,
        ]
    )


@pytest.mark.slow
@pytest.mark.parametrize("credit", ["turn", "token"])
def test_multiturn_ppo_learns_a_frozenlake_corridor(tiny_dir, tmp_path, credit):
    cfg = lake_config(tiny_dir, tmp_path, credit)
    result = train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    success = [r["env/win_rate"] for r in rows]
    first, last = sum(success[:2]) / 2, statistics.median(success[-3:])  # (one dip ignored: docstring)
    assert first < 0.25 and last > 0.8, success
    assert result["eval_after/win_rate"] == 1.0
    assert statistics.median(r["env/illegal_action_rate"] for r in rows[-3:]) < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "gigpo"])
def test_grpo_over_groups_of_episodes_learns_the_corridor(tiny_dir, tmp_path, estimator):
    """8 groups of 8 episodes from one start: no critic, each episode's group advantage on all its
    tokens. Measured on the CPU over seeds 0-7: the sampled success passes 0.8 after 7 to 9
    iterations and ends at 0.94-1.0, the greedy policy reaches the goal. At 3e-3 (the critic
    runs' former learning rate) an update now and then makes the replies lose their stop token (every
    move illegal, seeds 3 and 5 of 0-7): every group is then uniform, its advantages 0, and
    GRPO has no signal to recover from (the critic's whitened advantages always have one), hence
    1e-3 here. GiGPO (step groups by state on top) the same way."""
    algo = {"adv_estimator": estimator, "group_size": 8}
    cfg = lake_config(tiny_dir, tmp_path, "token", algo=algo, train={"learning_rate": 1e-3})
    result = train(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    success = [r["env/win_rate"] for r in rows]
    first, last = sum(success[:2]) / 2, statistics.median(success[-3:])
    assert first < 0.25 and last > 0.8, success
    assert result["eval_after/win_rate"] == 1.0
    assert "value_loss" not in rows[-1]  # no critic
    if estimator == "gigpo":  # one start state: the groups' turns share states
        assert min(r["env/shared_state_rate"] for r in rows) > 0.5
