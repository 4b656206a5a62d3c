"""FrozenLake as text: rendering, parsing, Gymnasium's dynamics, and random play's 1.4 % success."""

import random

import pytest

from ppokit.envs import evaluate_policy, expert_policy, make_env, play_episode
from ppokit.envs.frozenlake import ACTION_WORDS, FrozenLakeTextEnv, parse_direction
from ppokit.errors import UserError
from ppokit.lm.model.tiny import DEFAULT_ALPHABET


def test_observation_format_is_exact():
    env = FrozenLakeTextEnv()
    obs, info = env.reset(seed=0)
    assert obs == "p...\n.h.h\n...h\nh..g\nmove (left/down/right/up):"
    assert len(obs) == 46 and set(obs) <= set(DEFAULT_ALPHABET)
    assert info == {"legal_actions": ["left", "down", "right", "up"]}
    obs, reward, terminated, truncated, info = env.step("down")
    assert obs.startswith("....\nph.h\n") and (reward, terminated, truncated) == (0.0, False, False)
    assert info == {"illegal": False, "action": "down", "legal_actions": ["left", "down", "right", "up"]}
    obs, reward, terminated, truncated, info = env.step("r")  # into the hole at row 1, column 1
    assert obs.startswith("....\n.p.h\n") and (reward, terminated, info["outcome"]) == (0.0, True, "loss")


@pytest.mark.parametrize(
    "text,action",
    [
        ("left", 0),
        ("Down", 1),
        (" right\n", 2),
        ("up.", 3),
        ("u", 3),
        ("go left", 0),
        ("r", 2),
        ("i think down, then up", 1),
        ("", None),
        ("north", None),
        ("leftwards", None),
    ],
)
def test_parse_direction(text, action):
    assert parse_direction(text) == action


def test_illegal_action_ends_the_episode():
    env = FrozenLakeTextEnv(illegal_penalty=-0.5)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("jump")
    assert (reward, terminated, info["illegal"], info["outcome"]) == (-0.5, True, True, "loss")


def test_walls_keep_the_player_and_the_goal_pays():
    env = FrozenLakeTextEnv(goal_reward=2.0, step_reward=-0.01)
    env.reset(seed=0)
    obs, reward, *_ = env.step("left")
    assert obs.startswith("p...") and reward == pytest.approx(-0.01)
    for move in ["down", "down", "right", "down", "right", "right"]:
        obs, reward, terminated, _, info = env.step(move)
    assert obs.splitlines()[3] == "h..p" and terminated and reward == pytest.approx(1.99) and info["outcome"] == "win"


def test_truncation_after_max_steps():
    env = FrozenLakeTextEnv(max_steps=3)
    env.reset(seed=0)
    results = [env.step("left") for _ in range(3)]
    assert [r[3] for r in results] == [False, False, True] and results[-1][4]["outcome"] == "loss"
    assert not any(r[2] for r in results)


def test_slippery_dynamics_are_deterministic_given_the_seed_and_do_slip():
    def positions(seed):
        env = FrozenLakeTextEnv(is_slippery=True, max_steps=30)
        return [t.observation for t in play_episode(env, lambda o, i: "right", seed=seed).turns]

    assert positions(3) == positions(3)
    assert len({str(positions(s)) for s in range(20)}) > 5


def _success_probability(env, action_probs, steps=100):
    """Exact P(reach the goal within ``steps`` moves) from Gymnasium's transition table."""
    flat = "".join(env.desc)
    dist, win = {flat.index("S"): 1.0}, 0.0
    for _ in range(steps):
        nxt = {}
        for s, p in dist.items():
            for a, pa in enumerate(action_probs(s)):
                for q, s2, _, done in env._gym.P[s][a]:
                    if flat[s2] == "G":
                        win += p * pa * q
                    elif not done:
                        nxt[s2] = nxt.get(s2, 0.0) + p * pa * q
        dist = nxt
    return win


def test_random_play_reaches_the_goal_about_1_4_percent_of_the_time():
    env = FrozenLakeTextEnv()
    exact = _success_probability(env, lambda s: [0.25] * 4)
    assert exact == pytest.approx(0.01394, abs=1e-5)
    # slipping turns a uniformly random action into a uniformly random move: the same figure
    assert _success_probability(FrozenLakeTextEnv(is_slippery=True), lambda s: [0.25] * 4) == pytest.approx(exact)
    rng = random.Random(0)
    metrics = evaluate_policy(env, lambda obs, info: rng.choice(ACTION_WORDS), episodes=10_000, seed=0)
    # 4.3 standard errors: sqrt(0.0139 * 0.986 / 10000) = 0.00117
    assert metrics["env/win_rate"] == pytest.approx(exact, abs=0.005)


def test_expert_walks_a_shortest_path_and_plays_the_slippery_lake_optimally():
    env = make_env("frozenlake")
    metrics = evaluate_policy(env, expert_policy(env), episodes=3, seed=0)
    assert metrics["env/win_rate"] == 1.0 and metrics["env/turns_mean"] == 6.0
    slippery = FrozenLakeTextEnv(is_slippery=True)
    slippery.reset(seed=0)
    greedy = []
    for s in range(16):
        slippery.position = s
        greedy.append(ACTION_WORDS.index(slippery.expert_action()))
    exact = _success_probability(slippery, lambda s: [float(a == greedy[s]) for a in range(4)])
    assert exact == pytest.approx(0.7402, abs=1e-4)  # the optimal 4x4 slippery policy's success within 100 moves
    metrics = evaluate_policy(slippery, expert_policy(slippery), episodes=1000, seed=0)
    assert metrics["env/win_rate"] == pytest.approx(exact, abs=0.06)


def test_bad_maps_are_user_errors():
    with pytest.raises(UserError, match="unknown map_name '5x5'"):
        FrozenLakeTextEnv(map_name="5x5")
    with pytest.raises(UserError, match="desc must be equal-length rows"):
        FrozenLakeTextEnv(desc=["SFF", "FG"])
    env = FrozenLakeTextEnv(desc=["SH", "FG"])
    assert env.reset(seed=0)[0] == "ph\n.g\nmove (left/down/right/up):"


def test_letters_make_one_character_moves_the_listed_and_expert_actions():
    env = FrozenLakeTextEnv(letters=True)
    obs, info = env.reset(seed=0)
    assert obs.endswith("\nmove (l/d/r/u):") and info["legal_actions"] == ["l", "d", "r", "u"]
    assert env.expert_action() in ("d", "r")
    obs, _, _, _, info = env.step("d")  # parsed as before: a letter or a word
    assert obs.startswith("....\nph.h\n") and info["legal_actions"] == ["l", "d", "r", "u"]
    assert env.step("right")[4]["action"] == "right"  # into the hole; words still parse
