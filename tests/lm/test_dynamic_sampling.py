"""DAPO's dynamic sampling in single-turn runs (rollout.dynamic_sampling).

The sampler's batch against a naive selection on handmade draws; tiny seeded runs of the
arith preset on the test Llama: every trained group has reward variance and the batch is
exactly train.batch_size rows, the metrics are logged, the limit on generation batches
fills the batch with dropped groups, the verifier metric ignores length penalties, and a
run killed (SIGKILL) or resumed from a periodic checkpoint (also with
rollout.off_policy_steps=1) repeats the uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from resume_helpers import (
    LM_TIMING_KEYS,
    assert_same_metrics,
    copy_without_final_checkpoint,
    read_rows,
    start_and_wait,
    train_cmd,
)

from ppokit.algo.dynamic_sampling import groups_with_variance
from ppokit.cli import main
from ppokit.config import build_config
from ppokit.lm.generation.base import RolloutBatch
from ppokit.lm.single_turn.dynamic_sampling import DynamicSampler, merge_draw_metrics
from ppokit.lm.single_turn.source import RolloutPart, concat_parts

TIMING = LM_TIMING_KEYS


# --------------------------------------------------------------------------- the sampler
def handmade_part(draw: int, rewards: list[float], group_size: int) -> RolloutPart:
    """A generation batch of len(rewards) rows with prompts ``d<draw>g<group>`` and responses
    of different widths per draw (to exercise the padding of concat_parts)."""
    n, P, R = len(rewards), 3, 2 + draw
    ids = torch.arange(n * (P + R)).reshape(n, P + R) + 100 * draw
    mask = torch.ones(n, R)
    groups = [f"d{draw}g{i // group_size}" for i in range(n)]
    rollout = RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones(n, P + R, dtype=torch.long),
        position_ids=torch.arange(P + R).expand(n, -1),
        responses=ids[:, P:],
        mask=mask,
        truncated=torch.zeros(n, dtype=torch.bool),
        group_ids=torch.arange(n) // group_size,
        prompts=groups,
        texts=[f"{g}r{i}" for i, g in enumerate(groups)],
        items=[{"prompt": g} for g in groups],
        rollout_log_prob=-torch.rand(n, R),
        generation_time=1.0 + draw,
    )
    return RolloutPart(rollout, old_log_prob=-torch.rand(n, R), behaviour_time=0.5)


def sampler_cfg(batch_size: int, group_size: int, max_gen_batches: int):
    return build_config(
        [
            {
                "workload": "lm",
                "train": {"iterations": 1, "batch_size": batch_size},
                "algo": {"adv_estimator": "grpo", "group_size": group_size},
                "rollout": {"dynamic_sampling": {"enable": True, "max_gen_batches": max_gen_batches}},
            }
        ]
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("limit", [0, 2])
def test_the_batch_is_the_first_varied_groups_then_the_dropped_ones(seed, limit):
    gen = torch.Generator().manual_seed(seed)
    G, B = 4, 16  # 4 groups a batch
    sampler = DynamicSampler(sampler_cfg(B, G, limit))
    draws, done = [], False
    while not done:
        rewards = torch.randint(0, 2, (B,), generator=gen).float() * (torch.rand(B, generator=gen) < 0.3)
        part = handmade_part(len(draws), rewards.tolist(), G)
        marks = [{"reward_error": None, "reward_note": f"n{len(draws)}.{i}"} for i in range(B)]
        done = sampler.add(part, rewards, rewards, marks, {"reward_errors": 1.0, "reward/x_mean": len(draws)}, 0.25)
        draws.append((part, rewards))
        assert len(draws) < 50
    part, scores, marks, reward_metrics, time_reward, metrics = sampler.take(lambda p: concat_parts(p, 0))
    # naive: every (draw, group) in order, split by whether the group's rewards differ
    varied, flat = [], []
    for d, (_, r) in enumerate(draws):
        for g in range(B // G):
            values = r[g * G : (g + 1) * G].tolist()
            (varied if len(set(values)) > 1 else flat).append((d, g, values))
    chosen = varied[: B // G]
    padded = flat[: B // G - len(chosen)]
    expect_prompts = [f"d{d}g{g}" for d, g, _ in chosen + padded for _ in range(G)]
    assert part.rollout.prompts == expect_prompts and len(part.rollout) == B
    assert scores.tolist() == [v for _, _, values in chosen + padded for v in values]
    assert part.rollout.group_ids.tolist() == [i // G for i in range(B)]
    assert [m["reward_note"] for m in marks] == [f"n{d}.{g * G + i}" for d, g, _ in chosen + padded for i in range(G)]
    # the rows' tensors travel with them (each row's ids are unique to its draw and row)
    for row, (d, g, _) in enumerate([x for x in chosen + padded for _ in range(G)]):
        src = draws[d][0]
        i = g * G + row % G
        R = src.rollout.responses.shape[1]
        assert torch.equal(part.rollout.responses[row, :R], src.rollout.responses[i])
        assert torch.equal(part.old_log_prob[row, :R], src.old_log_prob[i])
        assert torch.equal(part.rollout.rollout_log_prob[row, :R], src.rollout.rollout_log_prob[i])
    if limit:
        assert len(draws) <= limit
    if len(varied) < B // G:
        assert len(draws) == limit  # only the limit ends a short iteration
    assert metrics["dynamic_sampling/gen_batches"] == len(draws)
    assert metrics["dynamic_sampling/samples_generated"] == B * len(draws)
    assert metrics["dynamic_sampling/padded_groups"] == len(padded)
    groups = len(varied) + len(flat)
    assert metrics["dynamic_sampling/kept_frac"] == len(varied) / groups
    assert metrics["dynamic_sampling/all_0_frac"] == sum(v[0] == 0 for *_, v in flat) / groups
    assert metrics["dynamic_sampling/all_1_frac"] == sum(v[0] == 1 for *_, v in flat) / groups
    assert metrics["dynamic_sampling/constant_other_frac"] == 0
    all_rewards = torch.cat([r for _, r in draws]).double()
    assert metrics["dynamic_sampling/reward_mean_generated"] == all_rewards.mean().item()
    assert part.rollout.generation_time == sum(1.0 + d for d in range(len(draws)))
    assert reward_metrics["reward_errors"] == len(draws) and time_reward == 0.25 * len(draws)
    assert sampler.draws == [] and sampler.kept_rows == 0  # the next iteration starts afresh


def test_draw_metrics_merge_by_kind():
    merged = merge_draw_metrics(
        [
            {"reward/verifier_mean": 1.0, "reward_errors": 2.0, "reward_errors/raise": 2.0, "reward_errors_total": 5.0},
            {"reward/verifier_mean": 0.0, "reward_errors": 1.0, "reward_notes/ok": 3.0, "reward_errors_total": 6.0},
        ],
        rows=[8, 24],
    )
    assert merged == {
        "reward/verifier_mean": 8 / 32,  # row-weighted mean
        "reward_errors": 3.0,  # counts: summed
        "reward_errors/raise": 2.0,
        "reward_errors_total": 6.0,  # a running value: the last
        "reward_notes/ok": 3.0,
    }


# --------------------------------------------------------------------------- tiny runs
@pytest.fixture(scope="module")
def digit_reward(tmp_path_factory) -> str:
    """1 when the response starts with a digit: on the untrained test Llama some groups of
    four samples vary, many do not."""
    path = tmp_path_factory.mktemp("ds-reward") / "digit.py"
    path.write_text("def digit(prompt, response, **fields):\n    return float(response[:1].isdigit())\n")
    return f"{path}:digit"


def run_args(tiny_dir: Path, reward: str, *overrides: str) -> list[str]:
    return [
        "arith",
        f"model.path={tiny_dir}",
        f"data.reward={reward}",
        "data.sft_epochs=0",
        "data.eval_size=8",
        "data.eval_every=0",
        "data.stop_at_accuracy=null",
        "train.iterations=4",
        "train.batch_size=16",
        "train.mini_batch_size=8",
        "train.micro_batch_size=8",
        "train.infer_micro_batch_size=16",
        "rollout.micro_batch_size=16",
        "rollout.max_new_tokens=2",
        "algo.adv_estimator=grpo",
        "algo.group_size=4",
        "rollout.dynamic_sampling.enable=true",
        "run.torch_threads=1",
        "run.precision=fp32",
        "run.tensorboard=false",
        "run.log_samples=4",
        "run.samples_every=1",
        *overrides,
    ]


def train(args: list[str], out: Path, name: str) -> Path:
    assert main(["train", *args, "--output-dir", str(out), "--name", name, "--no-progress"]) == 0
    return out / name


def test_every_trained_group_varies_and_the_batch_is_full(tiny_dir, digit_reward, tmp_path, trained_batches):
    batches = trained_batches
    run = train(run_args(tiny_dir, digit_reward, "rollout.dynamic_sampling.max_gen_batches=0"), tmp_path, "ds")
    rows = read_rows(run)
    assert len(batches) == len(rows) == 4
    for batch, row in zip(batches, rows):
        scores, gids = batch.tensors["scores"], batch.tensors["group_ids"]
        assert len(batch) == 16 and batch.tensors["input_ids"].shape[0] == 16
        assert groups_with_variance(scores, group_ids=gids).all()  # no group without signal
        assert torch.bincount(gids).tolist() == [4] * 4
        prompt_ids = batch.tensors["input_ids"][:, : -batch.tensors["responses"].shape[1]]  # (16, P)
        for g in range(4):  # a group's rows answer one prompt
            rows_g = prompt_ids[gids == g]
            assert (rows_g == rows_g[0]).all()
        assert row["dynamic_sampling/padded_groups"] == 0 and row["reward_std"] > 0
        draws = row["dynamic_sampling/gen_batches"]
        assert draws >= 1 and row["dynamic_sampling/samples_generated"] == 16 * draws
        shares = ("kept_frac", "all_0_frac", "all_1_frac", "constant_other_frac")
        assert sum(row[f"dynamic_sampling/{k}"] for k in shares) == pytest.approx(1.0)
        assert row["dynamic_sampling/kept_frac"] * 4 * draws >= 4
    assert any(r["dynamic_sampling/gen_batches"] > 1 for r in rows)  # the test draws more prompts
    totals = [r["dynamic_sampling/samples_generated_total"] for r in rows]
    assert totals == list(
        torch.cumsum(torch.tensor([r["dynamic_sampling/samples_generated"] for r in rows]), 0).tolist()
    )
    logged = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    for it in range(4):
        group = [r for r in logged if r["iteration"] == it]
        assert len({r["prompt"] for r in group}) == 1 and len({r["reward"] for r in group}) == 2  # a kept group


def test_at_the_limit_the_batch_is_filled_with_dropped_groups(tiny_dir, tmp_path, trained_batches):
    """exact_match on the untrained model: every group is all 0; after max_gen_batches the
    iteration trains on the first dropped groups (the first generation batch) and goes on."""
    batches = trained_batches
    args = run_args(tiny_dir, "exact_match", "rollout.dynamic_sampling.max_num_gen_batches=2", "train.iterations=2")
    rows = read_rows(train(args, tmp_path, "limit"))
    assert len(rows) == 2 and len(batches) == 2
    for batch, row in zip(batches, rows):
        assert len(batch) == 16
        assert row["dynamic_sampling/gen_batches"] == 2 and row["dynamic_sampling/samples_generated"] == 32
        assert row["dynamic_sampling/padded_groups"] == 4 and row["dynamic_sampling/kept_frac"] == 0
        assert row["dynamic_sampling/all_0_frac"] == 1 and row["reward_mean"] == 0


def test_the_verifier_metric_ignores_length_penalties(tiny_dir, tmp_path):
    """DAPO's overlong penalty makes the rewards of all-wrong groups differ by length: the
    sequence reward keeps such groups, the verifier's score (verl: acc) does not."""
    shaped = [
        "rollout.max_new_tokens=4",
        "data.shaping.overlong_cache_length=3",
        "train.iterations=1",
        "rollout.dynamic_sampling.max_gen_batches=1",
    ]
    by_reward = read_rows(train(run_args(tiny_dir, "exact_match", *shaped), tmp_path, "reward"))[0]
    by_acc = read_rows(
        train(run_args(tiny_dir, "exact_match", *shaped, "rollout.dynamic_sampling.metric=acc"), tmp_path, "acc")
    )[0]
    assert by_reward["reward/overlong_frac"] > 0 and by_reward["dynamic_sampling/kept_frac"] > 0
    assert by_acc["dynamic_sampling/kept_frac"] == 0 and by_acc["dynamic_sampling/all_0_frac"] == 1
    assert by_acc["dynamic_sampling/padded_groups"] == 4


# --------------------------------------------------------------------------- exact resume
@pytest.mark.parametrize("off_policy", [0, 1])
def test_a_resumed_run_repeats_the_uninterrupted_one(tiny_dir, digit_reward, tmp_path, off_policy):
    """From the periodic checkpoint after iteration 2 (the prompt stream, RNGs, the queued
    batch with rollout.off_policy_steps=1, the sampler's count), iterations 2-3 again."""
    args = run_args(tiny_dir, digit_reward, f"rollout.off_policy_steps={off_policy}", "run.checkpoint_every=2")
    finished = train(args, tmp_path, "ref")
    rows = read_rows(finished)
    assert any(r["dynamic_sampling/gen_batches"] > 1 for r in rows[2:])  # the resumed part draws more
    run = copy_without_final_checkpoint(finished, tmp_path / "run")
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    timing = TIMING | ({"time_behaviour_log_prob"} if off_policy else set())
    assert_same_metrics(read_rows(run), rows, 4, timing)
    assert (run / "samples.jsonl").read_text() == (finished / "samples.jsonl").read_text()


@pytest.mark.slow
def test_sigkill_then_resume_matches_the_uninterrupted_run(tiny_dir, digit_reward, tmp_path):
    args = run_args(tiny_dir, digit_reward, "run.checkpoint_every=1")
    reference = train(args, tmp_path, "ref")
    run_dir = tmp_path / "killed"
    proc = start_and_wait(
        train_cmd(*args, "--output-dir", str(tmp_path), "--name", "killed", "--no-progress"), run_dir, 2
    )
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert 2 <= len(read_rows(run_dir)) < 4, err
    assert main(["train", "--resume", str(run_dir), "--no-progress"]) == 0
    assert_same_metrics(read_rows(run_dir), read_rows(reference), 4, TIMING)
    assert (run_dir / "samples.jsonl").read_text() == (reference / "samples.jsonl").read_text()
