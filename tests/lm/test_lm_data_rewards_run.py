"""A language-model run on a user's data with a user's failing reward function, and epochs that resume.

- a reward function that raises on some samples and hangs on others: each gets
  ``data.reward_on_error``, is counted in the metrics and marked in ``samples.jsonl``;
  the run goes on; the worker pool is started once and closed at the end;
- ``data.max_reward_errors``: a count over the run, or a fraction of a batch, stops the
  run with one line (exit status 2) and keeps what was written;
- several epochs over the data: each epoch is a permutation of the prompts fixed by the
  seed, and a run resumed from a checkpoint at an epoch boundary or in the middle of an
  epoch continues the same order and step count as the uninterrupted run (verl PRs 5725
  and 7401: a resume at an epoch boundary ran zero steps there).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from resume_helpers import LM_TIMING_KEYS, assert_same_metrics, read_rows

from ppokit.cli import main
from ppokit.lm.rewards import pool as reward_pool
from ppokit.persistence import rundir

TIMING = LM_TIMING_KEYS
REWARD = """
import time

def flaky(prompt, response, mode):
    if mode == "raise":
        raise ValueError("bad sample")
    if mode == "hang":
        time.sleep(120)
    return 1.0
"""


def base_args(tiny_dir, out: Path, name: str, data: Path, reward: str, *extra: str) -> list[str]:
    return [
        "train",
        "arith",
        f"model.path={tiny_dir}",
        f"data.prompts={data}",
        f"data.reward={reward}",
        "data.sft_epochs=0",
        "data.eval_size=0",
        "rollout.max_new_tokens=3",
        "run.precision=fp32",
        "run.tensorboard=false",
        "run.torch_threads=1",
        "--output-dir",
        str(out),
        "--name",
        name,
        "--no-progress",
        *extra,
    ]


@pytest.fixture
def flaky_data(tmp_path) -> tuple[Path, str]:
    data = tmp_path / "data.jsonl"
    rows = [
        {"question": "1+1=", "mode": "ok"},
        {"question": "2+2=", "mode": "raise"},
        {"question": "3+3=", "mode": "hang"},
        {"question": "4+4=", "mode": "ok"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "flaky.py").write_text(REWARD)
    return data, f"{tmp_path / 'flaky.py'}:flaky"


def test_failing_rewards_get_reward_on_error_are_counted_and_marked(tiny_dir, tmp_path, flaky_data, monkeypatch):
    starts, closes = [], []
    real_init, real_close = reward_pool.RewardPool.__init__, reward_pool.RewardPool.close
    monkeypatch.setattr(
        reward_pool.RewardPool, "__init__", lambda self, *a, **k: (starts.append(1), real_init(self, *a, **k))[1]
    )
    monkeypatch.setattr(reward_pool.RewardPool, "close", lambda self: (closes.append(1), real_close(self))[1])
    data, reward = flaky_data
    args = base_args(
        tiny_dir,
        tmp_path,
        "run",
        data,
        reward,
        "data.prompt_key=question",
        "data.reward_timeout=1",
        "data.reward_on_error=-0.5",
        "data.max_reward_errors=null",
        "data.reward_workers=2",
        "train.iterations=2",
        "train.batch_size=8",
        "train.mini_batch_size=8",
        "algo.group_size=2",
        "run.log_samples=8",
        "run.samples_every=1",
    )
    assert main(args) == 0
    assert len(starts) == 1 and len(closes) >= 1  # one pool for the run, closed at its end
    rows = read_rows(tmp_path / "run")
    for row in rows:  # every batch holds all 4 prompts, twice each
        assert row["reward_errors"] == 4 and row["reward_errors/error"] == 2 and row["reward_errors/timeout"] == 2
        assert row["reward_mean"] == pytest.approx((4 * 1.0 + 4 * -0.5) / 8)
    assert rows[-1]["reward_errors_total"] == 8
    samples = [json.loads(line) for line in (tmp_path / "run" / rundir.SAMPLES_FILE).read_text().splitlines()]
    assert len(samples) == 16
    for sample in samples:
        mode = sample["fields"]["mode"]
        if mode == "ok":
            assert sample["reward_error"] is None and sample["reward"] == 1.0
        else:
            want = "error: ValueError: bad sample" if mode == "raise" else "timeout: timed out after 1 s"
            assert sample["reward_error"] == want and sample["reward"] == -0.5


@pytest.mark.parametrize(
    "limit, message, rows",
    [
        ("5", "failed on 8 samples so far (more than data.max_reward_errors=5); most often", 1),  # count over the run
        ("0.25", "failed on 4 of 8 samples (more than data.max_reward_errors=0.25 of the batch)", 0),  # per batch
    ],
)
def test_too_many_reward_errors_stop_the_run_with_one_line(
    tiny_dir, tmp_path, flaky_data, capsys, limit, message, rows
):
    data, reward = flaky_data
    args = base_args(
        tiny_dir,
        tmp_path,
        "run",
        data,
        reward,
        "data.prompt_key=question",
        "data.reward_timeout=1",
        f"data.max_reward_errors={limit}",
        "train.iterations=3",
        "train.batch_size=8",
        "train.mini_batch_size=8",
        "algo.group_size=2",
    )
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ppokit: error: reward function") and message in err[0], err
    assert len(read_rows(tmp_path / "run")) == rows  # what was written stays


# ----------------------------------------------------------------------------- epochs and resume
EPOCH_PROMPTS = 6
ITERATIONS = 7  # 2 prompts per iteration: epochs end after iterations 2 and 5


@pytest.fixture(scope="module")
def epoch_run(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("epochs")
    data = root / "data.parquet"
    import datasets

    datasets.Dataset.from_list(
        [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(EPOCH_PROMPTS)]
    ).to_parquet(str(data))
    args = base_args(
        tiny_dir,
        root,
        "ref",
        data,
        "exact_match",
        f"train.iterations={ITERATIONS}",
        "train.batch_size=4",
        "train.mini_batch_size=4",
        "algo.group_size=2",
        "run.log_samples=4",
        "run.samples_every=1",
        "run.checkpoint_every=1",
        "run.keep_checkpoints=10",
        "seed=5",
    )
    assert main(args) == 0
    return root, root / "ref"


def prompts_by_iteration(run: Path) -> list[list[str]]:
    samples = [json.loads(line) for line in (run / rundir.SAMPLES_FILE).read_text().splitlines()]
    out: dict[int, list[str]] = {}
    for s in samples:
        out.setdefault(s["iteration"], []).append(s["prompt"])
    return [sorted(set(out[i]), key=out[i].index) for i in sorted(out)]


def test_each_epoch_is_a_seeded_permutation_of_the_data(epoch_run):
    _, run = epoch_run
    order = prompts_by_iteration(run)
    assert len(order) == ITERATIONS and all(len(p) == 2 for p in order)
    epoch0, epoch1 = sum(order[0:3], []), sum(order[3:6], [])
    everything = sorted(f"{i}+{i}=" for i in range(EPOCH_PROMPTS))
    assert sorted(epoch0) == everything and sorted(epoch1) == everything  # each prompt once per epoch
    assert epoch0 != epoch1  # reshuffled (seed 5)
    rows = read_rows(run)
    assert [r["data_epoch"] for r in rows][2] == 1.0 and rows[5]["data_epoch"] == 2.0


@pytest.mark.parametrize("resume_at", [3, 4], ids=["epoch_boundary", "mid_epoch"])
def test_a_resume_continues_the_same_order_and_step_count(epoch_run, resume_at, tmp_path):
    _, ref = epoch_run
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    shutil.rmtree(run / rundir.FINAL_DIR)
    for it in range(resume_at + 1, ITERATIONS + 1):
        path = rundir.periodic_checkpoint_path(run, it)
        if path.exists():
            shutil.rmtree(path)
    assert rundir.latest_checkpoint(run) == rundir.periodic_checkpoint_path(run, resume_at)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert prompts_by_iteration(run) == prompts_by_iteration(ref)
    assert_same_metrics(read_rows(run), read_rows(ref), ITERATIONS, TIMING)
