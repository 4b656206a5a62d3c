"""The multi-turn rollout source through the workload: budgets, failures, user environments, self-play.

Every test builds the real components (``MultiTurnWorkload.build``) on the small test
model and checks what ``collect`` (and the scorer, the advantages) produce.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lm_helpers import randomize

from ppokit.config import build_config
from ppokit.envs import CURRENT
from ppokit.envs.checks import EnvError
from ppokit.lm.model.hf import load_tokenizer
from ppokit.lm.multi_turn.advantages import trajectory_advantages
from ppokit.lm.multi_turn.opponents import OPPONENT
from ppokit.lm.multi_turn.source import seat_actors_of
from ppokit.lm.multi_turn.workload import MultiTurnWorkload

ENVS = Path(__file__).with_name("textenvs.py")
pytestmark = pytest.mark.filterwarnings("ignore:Seems like .optimizer.step:UserWarning")


def mt_config(tiny_dir, tmp_path, textenv=None, **sections):
    base = {
        "workload": "lm",
        "seed": 3,
        "model": {"path": str(tiny_dir), "cpu_kernels": False},
        "textenv": {"env": f"{ENVS}:Counter", "eval_episodes": 0, "max_turns": 4},
        "rollout": {"max_new_tokens": 3, "temperature": 1.0},
        "train": {
            "batch_size": 8,
            "mini_batch_size": 4,
            "micro_batch_size": 8,
            "infer_micro_batch_size": 8,
            "epochs": 1,
            "iterations": 2,
            "learning_rate": 1e-3,
        },
        "algo": {"gamma": 1.0, "gae_lambda": 1.0},
        "run": {"precision": "fp32", "progress": False, "tensorboard": False, "output_dir": str(tmp_path)},
    }
    base["textenv"].update(textenv or {})
    return build_config([base, sections])


def build(cfg, tmp_path):
    return MultiTurnWorkload(cfg).build(tmp_path / "run")


def trajectories_of(batch):
    """traj -> list of rows."""
    out = {}
    for row, e in enumerate(batch.tensors["traj_index"].tolist()):
        out.setdefault(e, []).append(row)
    return out


# ----------------------------------------------------------------------------- budgets
def test_a_user_env_from_a_file_truncated_by_max_turns_bootstraps_from_its_next_observation(tiny_dir, tmp_path):
    # (every episode's next observation is "3:": whitening would remove the common bootstrap)
    cfg = mt_config(tiny_dir, tmp_path, {"max_turns": 3}, algo={"normalize_adv": False})
    c = build(cfg, tmp_path)
    randomize(c.learner.policy, seed=1)  # a critic that says something
    batch = c.source.collect(0)
    assert batch.metrics["env/truncated_by_max_turns"] == 1.0 and batch.metrics["env/turns_mean"] == 3
    assert 0.01 < batch.metrics["memory/peak_gb/generate"] < 100  # the largest generation call's peak
    rows = trajectories_of(batch)
    assert len(rows) == 8 and all(len(r) == 3 for r in rows.values())  # state mode: one row per turn
    tok = load_tokenizer(tiny_dir)
    assert batch.extras["bootstrap_input_ids"][0].tolist()[-3:] == tok("3:")["input_ids"]  # the next observation
    assert batch.extras["traj_truncated"].all()
    c.scorer.score(batch)
    last = batch.extras["last_values"]
    boot = {k: batch.extras[k] for k in ("bootstrap_input_ids", "bootstrap_attention_mask")}
    pad = torch.zeros_like(boot["bootstrap_input_ids"][:, :1])
    am = torch.cat([boot["bootstrap_attention_mask"], pad], 1)
    want = c.learner.policy.values(
        {
            "input_ids": torch.cat([boot["bootstrap_input_ids"], pad], 1),
            "attention_mask": am,
            "position_ids": (am.cumsum(1) - 1).clamp(min=0),
            "responses": pad,
        }
    )[:, 0]
    torch.testing.assert_close(last[batch.extras["bootstrap_traj"]], want)
    assert last.abs().min() > 0
    # the bootstrap enters the advantage: gamma = lambda = 1, so it adds V(next) to every action token
    adv, _ = trajectory_advantages(cfg, batch)
    batch.extras["last_values"] = torch.zeros_like(last)
    adv0, _ = trajectory_advantages(cfg, batch)
    shift = last[batch.tensors["traj_index"]][:, None] * batch.tensors["mask"]
    torch.testing.assert_close(adv - adv0, shift)


def test_truncation_by_the_episode_token_budget(tiny_dir, tmp_path):
    cfg = mt_config(tiny_dir, tmp_path, {"max_turns": 50, "max_episode_tokens": 8})
    c = build(cfg, tmp_path)
    batch = c.source.collect(0)
    assert batch.metrics["env/truncated_by_episode_tokens"] == 1.0
    t = batch.tensors
    for rows in trajectories_of(batch).values():
        tokens = [int(t["mask"][r].sum()) for r in rows]
        # every turn started with room for max_new_tokens (3); the next one had none
        assert all(sum(tokens[:k]) + 3 <= 8 for k in range(len(tokens)))
        assert sum(tokens) + 3 > 8
    assert batch.extras["traj_truncated"].all() and len(batch.extras["bootstrap_traj"]) == 8


def test_truncation_by_the_models_context_in_message_mode(tiny_dir, tmp_path):
    # the test model has 64 positions; a 40-character first observation, then "n:" after each action
    cfg = mt_config(
        tiny_dir,
        tmp_path,
        {"max_turns": 50, "kwargs": {"observation_mode": "message", "first": "count with me, one number a turn:"}},
    )
    c = build(cfg, tmp_path)
    batch = c.source.collect(0)
    assert batch.metrics["env/truncated_by_context"] == 1.0
    t = batch.tensors
    assert len(t["traj_index"]) == 8  # message mode: one row per trajectory
    lengths = t["attention_mask"].sum(1)
    bootstrap_lengths = batch.extras["bootstrap_attention_mask"].sum(1)
    assert (bootstrap_lengths + 3 > 64).all()  # the next turn would not have fit
    assert (lengths <= 64).all()
    # turn numbers run 0.. along each row, on the action tokens only
    for row in range(8):
        turns = t["turn_index"][row][t["mask"][row] == 1].tolist()
        assert (
            turns == sorted(turns) and turns[0] == 0 and len(set(turns)) == batch.tensors["turn_index"][row].max() + 1
        )


def test_the_per_turn_token_budget_cuts_replies_not_episodes(tiny_dir, tmp_path):
    cfg = mt_config(tiny_dir, tmp_path, {"max_turns": 3}, rollout={"max_new_tokens": 2})
    c = build(cfg, tmp_path)
    batch = c.source.collect(0)
    t = batch.tensors
    lengths = t["mask"].sum(1).long()  # state mode: one turn per row
    assert lengths.min() >= 1 and lengths.max() <= 2
    last = t["responses"].gather(1, (lengths - 1)[:, None])[:, 0]
    stops = torch.tensor(sorted(c.source.player.codec.stop_ids), device=last.device)  # where the batch is
    cut = (lengths == 2) & ~torch.isin(last, stops)  # reached the budget without a stop token
    assert cut.any()
    assert batch.metrics["env/reply_cut_rate"] == pytest.approx(cut.float().mean().item())
    # a cut reply is still the turn's action: the episodes go on to max_turns
    assert batch.metrics["env/turns_mean"] == 3 and batch.metrics["env/truncated_by_max_turns"] == 1.0
    assert batch.metrics["env/truncated_by_episode_tokens"] == batch.metrics["env/truncated_by_context"] == 0


def test_the_environments_time_limit_bootstraps_or_not_as_configured(tiny_dir, tmp_path):
    cfg = mt_config(tiny_dir, tmp_path, {"max_turns": 50, "kwargs": {"time_limit": 2}})
    batch = build(cfg, tmp_path).source.collect(0)
    assert batch.metrics["env/truncated_by_env"] == 1.0 and batch.metrics["env/truncated_rate"] == 1.0
    assert len(batch.extras["bootstrap_traj"]) == 8
    cfg = mt_config(tiny_dir, tmp_path, {"max_turns": 50, "kwargs": {"time_limit": 2}, "truncation": "terminal"})
    c = build(cfg, tmp_path / "terminal")
    randomize(c.learner.policy, seed=1)
    batch = c.source.collect(0)
    assert "bootstrap_traj" not in batch.extras
    c.scorer.score(batch)
    assert batch.extras["last_values"].eq(0).all()


# ----------------------------------------------------------------------------- bad environments
def test_an_env_that_raises_ends_that_episode_with_the_failure_reward_and_the_run_goes_on(tiny_dir, tmp_path):
    cfg = mt_config(tiny_dir, tmp_path, {"kwargs": {"raise_on": 2}, "failure_reward": -2.5, "max_failure_rate": 1.0})
    c = build(cfg, tmp_path)
    batch = c.source.collect(0)
    failed = batch.metrics["env/failures"]
    assert 0 < failed < 8
    assert batch.metrics["env/failure_rate"] == failed / 8
    t = batch.tensors
    one_turn = [rows for rows in trajectories_of(batch).values() if len(rows) == 1]
    assert len(one_turn) == failed and all(t["token_scores"][r[0]].sum() == -2.5 for r in one_turn)
    c.scorer.score(batch)  # and the iteration trains
    batch.tensors.update(zip(("advantages", "returns"), trajectory_advantages(cfg, batch)))
    assert c.learner.update(batch, 0)["epochs"] == 1
    cfg = mt_config(tiny_dir, tmp_path, {"kwargs": {"raise_on": 2}, "max_failure_rate": 0.1})
    with pytest.raises(
        EnvError,
        match=r"environment '.*textenvs.py:Counter' failed in \d of 8 episodes \(first: "
        r"RuntimeError: tool crashed on seed \d+\); fix the environment",
    ):
        build(cfg, tmp_path / "strict").source.collect(0)


def test_an_env_returning_something_other_than_text_is_a_one_line_error(tiny_dir, tmp_path):
    cfg = mt_config(tiny_dir, tmp_path, {"kwargs": {"bad_return": True}})
    with pytest.raises(
        EnvError,
        match=r"^environment '.*textenvs.py:Counter' step returned a int \(42\) as the "
        r"observation; return a str or a list of",
    ):
        build(cfg, tmp_path).source.collect(0)


def test_a_user_env_that_does_not_exist_is_named(tiny_dir, tmp_path):
    cfg = mt_config(tiny_dir, tmp_path, {"env": f"{ENVS}:Countr"})
    with pytest.raises(EnvError, match=r"has no attribute 'Countr'; did you mean 'Counter'"):
        MultiTurnWorkload(cfg).check_inputs()


# ----------------------------------------------------------------------------- self-play
def selfplay_config(tiny_dir, tmp_path, **pool):
    return mt_config(
        tiny_dir,
        tmp_path,
        {"env": "tictactoe", "kwargs": {"opponent": "self", "illegal_penalty": -1}, "max_turns": 9, "pool": pool},
        rollout={"max_new_tokens": 2},
    )


def first_free_cell(generate, tok):
    """``generate`` with each reply replaced by the board's first free cell (then end of
    text): a player that never moves illegally, so every game lasts five moves or more."""
    digit = {d: tok(d, add_special_tokens=False)["input_ids"] for d in "123456789"}

    def play(actor, prompts, greedy):
        generate(actor, prompts, greedy)  # the model still generates for the seat's actor
        boards = [tok.decode(p)[-22:-10] for p in prompts]  # "123\n456\n789\n" of "...x to move:"
        moves = [next(ch for ch in board if ch in digit) for board in boards]
        return [digit[m] + [tok.eos_token_id] for m in moves], moves

    return play


def test_self_play_seats_alternate_and_both_current_seats_are_trained(tiny_dir, tmp_path, monkeypatch):
    c = build(selfplay_config(tiny_dir, tmp_path), tmp_path)
    result = c.source.player.play([11, 12, 13, 14], seat_actors=seat_actors_of(c.source.episodes(5)[1]))
    # assign_seat(alternate): (episode number + seed) % 2 over the run's episode count (iteration * n + i)
    assert [a["learner"] for a in result.actors] == [(5 * 4 + i + 3) % 2 for i in range(4)]
    assert all(a[0] == a[1] == CURRENT for a in result.actors)
    for e in range(4):
        seats = sorted(t.seat for t in result.trajectories if t.episode == e)
        moves = sum(r.turns for r in result.records[e].values())
        assert seats == ([0, 1] if moves > 1 else [0])  # every seat that moved is trained on
    # How many games outlast the first move depends on what the untrained model samples (another
    # device's random stream: all 8 first moves illegal), so collect here with legal moves only:
    # both seats of every game move, and both are trained.
    monkeypatch.setattr(
        c.source.player, "generate", first_free_cell(c.source.player.generate, load_tokenizer(tiny_dir))
    )
    batch = c.source.collect(0)
    assert batch.metrics["trajectories"] == 2 * 8
    # x takes 1, 3, 5, 7 and wins on the diagonal 3-5-7 at the 7th move: one row per move, both seats'
    assert batch.metrics["rows"] == 8 * 7
    assert "selfplay/pool_size" not in batch.metrics  # no pool configured


def test_the_opponent_pool_plays_snapshots_from_a_spare_adapter_slot(tiny_dir, tmp_path):
    cfg = selfplay_config(tiny_dir, tmp_path, snapshot_every=1, current_prob=0.0)
    c = build(cfg, tmp_path)
    source, policy = c.source, c.learner.policy
    assert source.pool.ids() == ["update-0"]  # the starting policy, pinned
    tok = load_tokenizer(tiny_dir)
    prompt = tok("123\n456\n789\nx to move:")["input_ids"]
    before = source.player.generate(CURRENT, [prompt] * 3, True)
    randomize(policy, std=0.5, seed=4)  # the actor moves on
    after = source.player.generate(CURRENT, [prompt] * 3, True)
    assert after != before
    # the snapshot still plays the starting policy's moves, and the actor is untouched by playing it
    actor = {n: p.detach().clone() for n, p in policy.lm.named_parameters() if ".actor." in n}
    assert source.player.generate("update-0", [prompt] * 3, True) == before
    assert all(torch.equal(p, actor[n]) for n, p in policy.lm.named_parameters() if ".actor." in n)
    assert source.player.generate(CURRENT, [prompt] * 3, True) == after
    # the slot is never trained: in no optimizer group, and frozen whenever the actor is active
    trained = {id(p) for g in c.learner.trainer.optimizer.param_groups for p in g["params"]}
    slot = [p for n, p in policy.lm.named_parameters() if f".{OPPONENT}." in n]
    assert slot and not any(id(p) in trained for p in slot) and not any(p.requires_grad for p in slot)
    # every episode: the learner's seat is the current policy, the other the snapshot; only the learner is trained
    batch = source.collect(0)
    assert batch.metrics["selfplay/vs_pool_episodes"] == 8 and batch.metrics["selfplay/vs_current_episodes"] == 0
    result = source.player.play(list(range(8)), seat_actors=seat_actors_of(source.episodes(1)[1]))
    assert result.trajectories and all(t.seat == result.actors[t.episode]["learner"] for t in result.trajectories)
    assert all(a[1 - a["learner"]] == "update-0" for a in result.actors)
    assert sum(source.pool.results()["update-0"].values()) == 8
    source.sync_weights(c.learner)  # one update later: a new snapshot
    assert source.pool.ids() == ["update-0", "update-1"]
    snap = source.opponents.tensors["update-1"]
    from peft import get_peft_model_state_dict

    now = get_peft_model_state_dict(policy.lm, adapter_name="actor")  # on the policy's device
    assert all(t.device.type == "cpu" for t in snap.values())  # snapshots wait in host memory
    assert snap.keys() == now.keys() and all(torch.equal(snap[k], now[k].cpu()) for k in snap)
    state = source.state_dict()  # what a checkpoint keeps, and gets back
    fresh = build(cfg, tmp_path / "fresh").source
    fresh.load_state_dict(state)
    assert fresh.pool.ids() == ["update-0", "update-1"] and fresh.updates == 1
    assert all(torch.equal(fresh.opponents.tensors["update-1"][k], snap[k]) for k in snap)


# ----------------------------------------------------------------------------- evaluation
def test_a_sampled_evaluation_draws_from_its_own_stream(tiny_dir, tmp_path):
    """textenv.eval_sampling=sampled: the episodes sample as rollouts do, every evaluation draws the
    same numbers, and the run's own random stream (the next rollout) is untouched."""
    textenv = {"env": "tictactoe", "kwargs": {"opponent": "random"}, "eval_episodes": 8, "max_turns": 5}
    greedy_parts = build(mt_config(tiny_dir, tmp_path / "g", textenv=textenv), tmp_path / "g")
    sampled_parts = build(
        mt_config(tiny_dir, tmp_path / "s", textenv={**textenv, "eval_sampling": "sampled"}), tmp_path / "s"
    )
    greedy = greedy_parts.evaluator.evaluate("before")
    torch.manual_seed(11)
    untouched = torch.rand(3)
    torch.manual_seed(11)
    first = sampled_parts.evaluator.evaluate("before")
    assert torch.equal(torch.rand(3), untouched)  # the run's stream is where it was
    again = sampled_parts.evaluator.evaluate("periodic")
    assert again == {k.replace("eval_before", "eval"): v for k, v in first.items()}  # the same draws
    assert greedy != first  # a random model's sampled replies differ from its greedy ones
    assert "episodes each, sampled at temperature 1)" in sampled_parts.evaluator.message("before", first)
