"""TextArena games as text environments (``textarena:<id>``): the API through ppokit's own
checks, seeds, whole games by random legal moves with their outcomes checked against the
game's state, invalid moves, the built-in opponent, message mode, one-line errors, and a short
``ppokit train`` on the built-in tiny model.

Every game used here runs offline (no NLTK download, no API key)."""

from __future__ import annotations

import json
import random
import sys

import pytest

pytest.importorskip("textarena")

from ppokit.cli import main  # noqa: E402
from ppokit.envs import (  # noqa: E402
    EnvError,
    checked_reset,
    checked_step,
    make_env,
    play_episode,
    random_legal_policy,
)
from ppokit.envs import textarena as tae  # noqa: E402
from ppokit.envs.textarena import TextArenaEnv, clean_action  # noqa: E402

TTT = "textarena:TicTacToe-v0"
KUHN = "textarena:KuhnPoker-v0"
LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def cell(action: str) -> int:
    assert action.startswith("[") and action.endswith("]"), action
    return int(action[1:-1])


# ----------------------------------------------------------------------------- actions and lists
@pytest.mark.parametrize(
    "text,last_bracket",
    [
        ("[4]", "[4]"),
        ("I considered [0] but play [4]", "[4]"),
        ("4", "[4]"),
        ("  call \n", "[call]"),
        ("", "[]"),
        ("[col 3] then", "[col 3]"),
    ],
)
def test_clean_action_keeps_the_last_bracketed_move_or_brackets_the_reply(text, last_bracket):
    assert clean_action(text) == last_bracket
    assert clean_action(text, "raw") == text


def test_listed_moves_are_read_from_the_games_list_without_templates():
    assert tae._listed_moves("Available Moves: '[0]', '[4]'") == ["[0]", "[4]"]
    assert tae._listed_moves("Your possible actions: '[check]', '[bet X]'") == ["[check]"]
    assert tae._listed_moves("Valid moves: [A4], [N1C2B1A1]\n[not] [this line]") == ["[A4]", "[N1C2B1A1]"]
    assert tae._listed_moves("rules: play [rock] or [paper]") is None


# ----------------------------------------------------------------------------- the API
@pytest.mark.parametrize(
    "spec,kwargs,players",
    [
        (TTT, {"opponent": "self"}, 2),
        (TTT, {"opponent": "random", "observation_mode": "message"}, 2),
        (KUHN, {"opponent": "self"}, 2),
        ("textarena:ConnectFour-v0", {}, 2),
        ("textarena:Nim-v0", {"opponent": "self"}, 2),
        ("textarena:GuessTheNumber-v0", {}, 1),
    ],
)
def test_reset_and_step_pass_ppokits_checks(spec, kwargs, players):
    env = make_env(spec, **kwargs)
    assert isinstance(env, TextArenaEnv) and env.env_name == spec and env.num_players == players
    assert env.observation_mode == kwargs.get("observation_mode", "state")
    obs, info = checked_reset(env, seed=0)
    assert obs.startswith("[GAME] ") and f"Player {info.get('player', 0)}" in obs.split("\n")[0]  # its prompt
    assert ("player" in info) == (players == 2)
    rng = random.Random(0)
    for guess in (7, 3, 12):
        legal = info.get("legal_actions") or [f"[{guess}]"]  # one player: guess the number
        result = checked_step(env, rng.choice(legal))
        assert result.reward == 0.0 or result.done
        if result.done:
            break
        obs, info = result.observation, result.info
        assert info["illegal"] is False and isinstance(info["action"], str)


def test_reset_seed_reproduces_the_episode_and_seeds_differ():
    def transcript(seed: int, env=None) -> list:
        env = env or make_env(KUHN, opponent="random", policy_seat=0)
        obs, info = env.reset(seed=seed)
        out = [obs, info]
        policy = random_legal_policy(random.Random(seed))
        while True:
            obs, reward, terminated, truncated, info = env.step(policy(obs, info))
            out += [obs, reward, info]
            if terminated:
                return out

    assert transcript(5) == transcript(5)
    env = make_env(KUHN, opponent="random", policy_seat=0)
    assert transcript(5, env) == transcript(5, env)  # the same instance, reset again
    assert len({json.dumps(transcript(s)) for s in range(6)}) > 1  # the deal depends on the seed


def test_games_do_not_touch_the_callers_random_stream_nor_each_other():
    random.seed(123)
    expected = [random.random() for _ in range(3)]
    alone = make_env(KUHN, opponent="self")
    obs_alone, info = alone.reset(seed=9)
    steps_alone = []
    policy = random_legal_policy(random.Random(0))
    actions = []
    while True:
        actions.append(policy(obs_alone, info))
        obs_alone, _, done, _, info = alone.step(actions[-1])
        steps_alone.append(obs_alone)
        if done:
            break

    random.seed(123)
    first = make_env(KUHN, opponent="self")
    other = make_env(KUHN, opponent="random", policy_seat=1)
    first.reset(seed=9)
    other.reset(seed=1)
    steps = []
    for action in actions:  # another game is played in between every step (a batched rollout)
        steps.append(first.step(action)[0])
        other_obs, _, other_done, _, other_info = other.step(random.choice(["[check]", "[bet]", "[call]", "[fold]"]))
        if other_done:
            other.reset(seed=2)
    assert steps == steps_alone
    assert [random.random() for _ in range(3)] != expected  # random.choice above drew from it
    random.seed(123)
    make_env(KUHN, opponent="random").reset(seed=4)
    assert [random.random() for _ in range(3)] == expected


# ----------------------------------------------------------------------------- whole games
def ttt_result(moves: list[int]) -> tuple[int | None, bool]:
    """(the winning seat or None, whether the board is full), replayed from the moves alone."""
    board = [None] * 9
    for i, c in enumerate(moves):
        assert board[c] is None
        board[c] = i % 2
        for a, b, d in LINES:
            if board[a] is not None and board[a] == board[b] == board[d]:
                return board[a], False
    return None, all(v is not None for v in board)


@pytest.mark.parametrize("seed", range(12))
def test_tictactoe_by_random_legal_moves_for_both_seats_ends_with_each_seats_outcome(seed):
    env = make_env(TTT, opponent="self")
    episode = play_episode(env, random_legal_policy(random.Random(seed)), seed=seed)
    moves = [cell(t.info["action"]) for t in episode.turns]
    assert [t.player for t in episode.turns] == [i % 2 for i in range(len(moves))]
    assert not any(t.info["illegal"] for t in episode.turns)
    winner, full = ttt_result(moves)
    last = episode.turns[-1].info
    if winner is None:
        assert full and len(moves) == 9
        assert last["outcomes"] == ["draw", "draw"] and last["rewards"] == [0.0, 0.0]
    else:
        assert winner == (len(moves) - 1) % 2  # the last mover made the line
        want = ["win", "loss"] if winner == 0 else ["loss", "win"]
        assert last["outcomes"] == want and last["rewards"] == [1.0 if o == "win" else -1.0 for o in want]
        assert last["outcome"] == "win" and episode.turns[-1].reward == 1.0
    for seat in (0, 1):
        record = episode.records[seat]
        assert record.outcome == last["outcomes"][seat]
        assert record.episode_return == last["rewards"][seat]  # the other seat's reward reaches it too
        assert sum(episode.seat_rewards(seat)) == last["rewards"][seat]


def test_kuhn_poker_played_to_the_end_rewards_the_seat_with_more_chips():
    outcomes = set()
    for seed in range(8):
        env = make_env(KUHN, opponent="self")
        episode = play_episode(env, random_legal_policy(random.Random(seed)), seed=seed)
        last = episode.turns[-1].info
        chips = env._game.state.game_state["player_chips"]
        assert sum(last["rewards"]) == 0
        for seat in (0, 1):
            mine, theirs = chips[seat], chips[1 - seat]
            want = "win" if mine > theirs else "loss" if mine < theirs else "draw"
            assert last["outcomes"][seat] == want and episode.records[seat].outcome == want
        assert all(t.info["action"] in ("[check]", "[bet]", "[call]", "[fold]") for t in episode.turns)
        assert episode.reset_info["player"] == 1  # Kuhn poker's first round opens with player 1
        outcomes.add(tuple(last["outcomes"]))
    assert len(outcomes) > 1


def test_connect_four_to_the_end_by_random_legal_moves():
    env = make_env("textarena:ConnectFour-v0", opponent="self")
    for seed in range(3):
        episode = play_episode(env, random_legal_policy(random.Random(seed)), seed=seed)
        last = episode.turns[-1].info
        assert not any(t.info["illegal"] for t in episode.turns) and 7 <= len(episode.turns) <= 42
        assert sorted(last["outcomes"]) in (["loss", "win"], ["draw", "draw"])
        if last["outcome"] == "win":
            assert "connect" in last["reason"].lower() or "won" in last["reason"].lower()


def test_guess_the_number_one_player_solved_by_bisection():
    env = make_env("textarena:GuessTheNumber-v0")
    for seed in range(3):
        obs, info = checked_reset(env, seed=seed)
        assert "player" not in info and "seat" not in info
        low, high = 1, 20
        for _ in range(10):
            guess = (low + high) // 2
            result = checked_step(env, f"My guess is [{guess}]")
            if result.done:
                break
            hint = result.observation.splitlines()[-1]
            low, high = (guess + 1, high) if "higher" in hint else (low, guess - 1)
        assert result.terminated and result.reward == 1.0 and result.info["outcome"] == "win"
        assert "rewards" not in result.info and result.info["illegal"] is False


# ----------------------------------------------------------------------------- invalid moves
def test_an_invalid_move_is_illegal_then_the_game_decides_retry_then_loss():
    env = make_env(TTT, opponent="self")
    checked_reset(env, seed=0)
    checked_step(env, "[4]")
    retry = checked_step(env, "[4]")  # occupied: TextArena lets player 1 try again
    assert retry.info["illegal"] is True and retry.info["illegal_reason"] == "cell 4 is already occupied."
    assert not retry.done and retry.reward == 0.0 and retry.info["player"] == 1
    assert "[4]" not in retry.info["legal_actions"]
    assert "attempted an invalid move" in retry.observation.splitlines()[-1] or "invalid move" in retry.observation
    lost = checked_step(env, "the centre")  # no [cell]: the second invalid move in a row loses
    assert lost.info["action"] == "[the centre]"
    assert lost.info["illegal"] is True and "format" in lost.info["illegal_reason"]
    assert lost.terminated and lost.reward == -1.0 and lost.info["outcome"] == "loss"
    assert lost.info["rewards"] == [1.0, -1.0] and lost.info["outcomes"] == ["win", "loss"]
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("[0]")


def test_error_allowance_zero_ends_the_game_at_the_first_invalid_move():
    env = make_env(KUHN, opponent="self", error_allowance=0)
    _, info = checked_reset(env, seed=0)
    result = checked_step(env, "[call]")  # no bet to call
    assert result.terminated and result.info["illegal"] is True
    assert "Action must be" in result.info["illegal_reason"]
    assert result.info["outcomes"][info["player"]] == "loss" and result.reward == -1.0


# ----------------------------------------------------------------------------- the opponent
def test_the_random_opponent_plays_legal_moves_and_the_learner_gets_its_seat():
    env = make_env(TTT, opponent="random")  # policy_seat: alternate
    seats = []
    for seed in range(10):
        obs, info = checked_reset(env, seed=seed)
        seats.append(info["seat"])
        assert info["player"] == info["seat"]
        assert len(info.get("opponent_actions", [])) == info["seat"]  # it opens when the learner is seat 1
        policy = random_legal_policy(random.Random(seed))
        moves = [cell(a) for a in info.get("opponent_actions", [])]
        while True:
            result = checked_step(env, policy(obs, info))
            moves += [cell(result.info["action"])] + [cell(a) for a in result.info.get("opponent_actions", [])]
            assert "invalid" not in result.observation
            if result.done:
                break
            obs, info = result.observation, result.info
            assert info["player"] == info.get("seat", seats[-1])
        winner, full = ttt_result(moves)
        want = "draw" if winner is None else "win" if winner == seats[-1] else "loss"
        assert result.info["outcome"] == want and result.info["outcomes"][seats[-1]] == want
        assert result.reward == {"win": 1.0, "draw": 0.0, "loss": -1.0}[want]
    assert seats == [0, 1] * 5
    assert make_env(TTT, policy_seat=1).reset(seed=0, options={"seat": 0})[1]["seat"] == 0


def test_the_random_opponent_falls_back_to_the_moves_the_game_showed():
    # Rock-paper-scissors lists no moves; its rules show [rock], [paper], [scissors], [r], [p], [s]
    env = make_env("textarena:IteratedRockPaperScissors-v0", opponent="random", policy_seat=0)
    obs, info = checked_reset(env, seed=3)
    assert "legal_actions" not in info
    seen = set()
    while True:
        result = checked_step(env, "[rock]")
        seen.update(result.info.get("opponent_actions", []))
        assert result.info["illegal"] is False
        if result.done:
            break
    assert seen <= {"[rock]", "[paper]", "[scissors]", "[r]", "[p]", "[s]"} and len(seen) > 1
    assert result.info["outcome"] in ("win", "draw", "loss")


def test_an_opponent_function_gets_the_observation_and_the_legal_moves():
    calls = []

    def first_legal(observation, info):
        calls.append((observation, info))
        return info["legal_actions"][0]

    env = make_env(TTT, opponent=first_legal, policy_seat=1)
    _, info = checked_reset(env, seed=0)
    assert info["opponent_actions"] == ["[0]"] and calls[0][1]["player"] == 0
    assert calls[0][0].startswith("[GAME] You are Player 0")
    result = checked_step(env, "[4]")
    assert result.info["opponent_actions"] == ["[1]"]


# ----------------------------------------------------------------------------- message mode
def test_message_mode_appends_what_state_mode_shows_without_the_players_own_moves():
    state = make_env(TTT, opponent="self")
    message = make_env(TTT, opponent="self", observation_mode="message")
    s_obs, s_info = state.reset(seed=1)
    m_obs, m_info = message.reset(seed=1)
    assert m_obs == s_obs and m_info == s_info and not m_obs.startswith("\n")
    appended = {0: m_obs, 1: ""}  # each seat's observations, as its stream appends them
    policy = random_legal_policy(random.Random(1))
    turns = 0
    while True:
        action = policy(s_obs, s_info)
        s_obs, _, done, _, s_info = state.step(action)
        m_obs, _, m_done, _, m_info = message.step(action)
        assert m_done == done
        if done:
            break
        turns += 1
        assert m_info == s_info
        seat = s_info["player"]
        assert m_obs.startswith("\n") == bool(appended[seat])  # a newline after the reply, not at the start
        appended[seat] += m_obs
        # the state transcript is the same text plus the seat's own moves, echoed on lines of their own
        own = f"[Player {seat}] "
        assert appended[seat] == "\n".join(ln for ln in s_obs.split("\n") if not ln.startswith(own))
    assert turns >= 4


def test_the_board_view_shows_the_rules_the_games_messages_and_the_latest_board_only():
    """view=board, as TextArena's -train variants: no moves echoed, no [GAME] tags, one board (the
    latest), this turn's invalid-move notice; the same game and infos as the whole transcript."""
    history = make_env(TTT, opponent="self")
    board = make_env(TTT, opponent="self", view="board")
    h_obs, h_info = history.reset(seed=3)
    b_obs, b_info = board.reset(seed=3)
    assert b_info == h_info and "[GAME]" not in b_obs and b_obs.startswith("You are Player 0 in Tic Tac Toe.")
    assert b_obs.endswith("Available Moves: " + ", ".join(f"'{m}'" for m in b_info["legal_actions"]))
    for move in ("[4]", "[0]"):
        h_obs, _, _, _, h_info = history.step(move)
        b_obs, _, _, _, b_info = board.step(move)
        assert b_info == h_info
    assert b_obs.count("Current Board:") == 1 and h_obs.count("Current Board:") == 3
    assert "Player 0 placed their symbol (O) in cell 4." in b_obs and "[Player" not in b_obs
    assert b_obs.split("Current Board:")[1] == h_obs.split("Current Board:")[-1]  # the latest board
    retry = board.step("[4]")  # occupied: the notice is shown on the retry, then no more
    assert retry[4]["illegal"] and "cell 4 is already occupied" in retry[0]
    assert "already occupied" not in board.step("[8]")[0]
    assert len(b_obs) < 0.7 * len(h_obs)


def test_an_instruction_follows_every_observation_and_invalid_moves_can_cost_reward():
    instruction = "Reply with one of the available moves, in brackets, and nothing else."
    env = make_env(TTT, opponent="self", view="board", instruction=instruction + "\n", invalid_move_reward=-0.1)
    obs, _ = env.reset(seed=0)
    assert obs.endswith("\n\n" + instruction)
    step = checked_step(env, "[4]")
    assert step.reward == 0.0 and step.observation.endswith("\n\n" + instruction)
    retry = checked_step(env, "[4]")  # occupied: the penalty at once
    assert retry.info["illegal"] and retry.reward == pytest.approx(-0.1) and not retry.done
    lost = checked_step(env, "[4]")  # the second in a row loses: the game's -1 plus the penalty
    assert lost.terminated and lost.reward == pytest.approx(-1.1) and lost.info["outcome"] == "loss"
    message = make_env(TTT, opponent="self", observation_mode="message", instruction=instruction)
    first, _ = message.reset(seed=0)
    assert first.endswith("\n\n" + instruction) and message.step("[4]")[0].endswith(instruction)
    # the defaults are unchanged: no instruction, no penalty
    plain = make_env(TTT, opponent="self")
    assert plain.reset(seed=0)[0].endswith("'[8]'")
    plain.step("[4]")
    assert plain.step("[4]")[1] == 0.0


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "spec,kwargs,message",
    [
        (
            "textarena:TicTacToe",
            {},
            "unknown TextArena game 'textarena:TicTacToe'; did you mean 'textarena:TicTacToe-v0'? "
            "list the ids with: python -m ppokit.envs.textarena",
        ),
        ("textarena:Nope-v9", {}, "unknown TextArena game 'textarena:Nope-v9'; list the ids with"),
        # the closest id is a refused game (DontSayIt-v0, which needs the network): a playable one is named
        ("textarena:Nonexist-v0", {}, "unknown TextArena game 'textarena:Nonexist-v0'; did you mean 'textarena:Bandit"),
        ("textarena:Wordle-v0", {}, "textarena:Wordle-v0 needs the network: it downloads NLTK corpora"),
        ("textarena:Debate-v0", {}, "needs the network and an API key: it asks OpenRouter models"),
        ("textarena:ThreePlayerTicTacToe-v0", {}, "is not a one- or two-player game"),
        (TTT, {"opponnent": "self"}, "does not take 'opponnent'; did you mean 'opponent'?"),
        (TTT, {"opponent": "heuristic"}, "unknown opponent 'heuristic'; valid: random, self"),
        (TTT, {"observation_mode": "chat"}, "observation_mode must be 'state' or 'message'"),
        (TTT, {"view": "last"}, "view must be 'history' or 'board'"),
        (TTT, {"view": "board", "observation_mode": "message"}, "view='board' is a state-mode view"),
        (TTT, {"instruction": 3}, "instruction must be text"),
        (TTT, {"invalid_move_reward": "-1"}, "invalid_move_reward must be a number"),
        (TTT, {"action_format": "first"}, "action_format must be"),
        (TTT, {"policy_seat": "x"}, "policy_seat must be 0, 1, 'alternate' or 'random'"),
        (TTT, {"error_allowance": -1}, "error_allowance must be a whole number >= 0"),
        ("textarena:GuessTheNumber-v0", {"opponent": "random"}, "is a one-player game; it takes no opponent"),
        (KUHN, {"game_kwargs": {"max_round": 5}}, "the game takes: max_rounds"),
    ],
)
def test_bad_ids_and_options_are_one_line(spec, kwargs, message):
    with pytest.raises(EnvError) as exc:
        make_env(spec, **kwargs)
    assert message in one_line(exc)


def test_missing_textarena_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "textarena", None)  # import textarena now fails
    want = "textenv.env=textarena:TicTacToe-v0: needs the optional package: pip install 'ppokit[textarena]'"
    with pytest.raises(EnvError) as exc:
        make_env(TTT)
    assert one_line(exc) == want
    assert main(["train", "tictactoe", f"textenv.env={TTT}", "textenv.kwargs={}"]) == 2
    assert capsys.readouterr().err == f"ppokit: error: {want}\n"


def test_cli_refuses_an_unknown_game_before_a_run_directory(tmp_path, capsys):
    status = main(["train", "tictactoe", "textenv.env=textarena:TicTacToo-v0", f"run.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "did you mean 'textarena:TicTacToe-v0'?" in err
    assert not list(tmp_path.iterdir())


def test_listing_the_ids(capsys):
    assert tae.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "textarena:TicTacToe-v0" in lines and "textarena:TicTacToe-v0-raw" not in lines
    assert any(line.startswith("textarena:Wordle-v0  (refused: needs the network") for line in lines)


# ----------------------------------------------------------------------------- end to end
def test_warm_start_demonstrations_are_legal_moves_on_the_rollouts_observations():
    from ppokit.lm.multi_turn.demonstrations import demonstration_examples

    env = make_env(TTT, opponent="random")
    records = demonstration_examples(env, "random", 16, seed=0, name=TTT)
    assert len(records) == 16
    for r in records:
        assert r["completion"] in r["legal_actions"] and r["prompt"].startswith("[GAME] You are Player")
        assert r["prompt"].endswith("Available Moves: " + ", ".join(f"'{m}'" for m in r["legal_actions"]))


@pytest.mark.slow
def test_ppokit_train_self_play_with_the_pool_on_tictactoe_v0(tmp_path, capsys):
    """Two PPO iterations of two self-play episodes on the built-in tiny model: the other seat
    is a pool snapshot, the evaluations play the built-in random opponent. Plumbing, not learning."""
    status = main(
        [
            "train",
            "tictactoe",
            f"textenv.env={TTT}",
            "textenv.kwargs={opponent: self}",
            "textenv.pool.snapshot_every=1",
            "textenv.pool.current_prob=0",
            "textenv.eval_opponents=[random]",
            "textenv.eval_episodes=2",
            "textenv.stop_at_win_rate=null",
            "textenv.max_turns=3",
            "data.sft_epochs=0",
            "model.tiny_max_positions=1024",
            "rollout.max_new_tokens=3",
            "train.iterations=2",
            "train.batch_size=2",
            "train.mini_batch_size=2",
            "train.micro_batch_size=2",
            "train.infer_micro_batch_size=2",
            "run.progress=false",
            "run.tensorboard=false",
            f"run.output_dir={tmp_path}",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"lm on {TTT} (state mode" in out
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "env/episodes" in r]
    assert len(train_rows) == 2
    for r in train_rows:
        assert r["env/episodes"] == 2 and r["selfplay/vs_pool_episodes"] == 2 and r["rows"] >= 2
        assert r["env/win_rate"] + r["env/draw_rate"] + r["env/loss_rate"] + r["env/truncated_rate"] >= 1 - 1e-9
        assert 0 <= r["env/illegal_action_rate"] <= 1
    assert any("eval_after/random/win_rate" in r for r in rows)
    sample = json.loads((run_dir / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].startswith("[GAME] You are Player")
