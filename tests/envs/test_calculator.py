"""The calculator tool: call and answer syntax, generated problems, the episode protocol."""

import random
from fractions import Fraction

import pytest

from ppokit.envs import checked_reset, checked_step, evaluate_policy, expert_policy, play_episode
from ppokit.envs.calculator import TEMPLATES, CalculatorEnv, generate_problem, parse_answer, parse_tool_action
from ppokit.expressions import evaluate
from ppokit.lm.model.tiny import DEFAULT_ALPHABET


@pytest.mark.parametrize(
    "text,parsed",
    [
        ("calc: 12*7", ("calc", "12*7")),
        ("calc:12*7\n", ("calc", "12*7")),
        ("CALC : 12 * 7 = 84", ("calc", "12 * 7")),
        ("first i multiply.\ncalc: 3*4\nanswer: 12", ("calc", "3*4")),
        ("<calc>(2+3)*4</calc> then <answer>20</answer>", ("calc", "(2+3)*4")),
        ("I know it.\n<answer> 79 </answer>", ("answer", "79")),
        ("answer: 79\ncalc: 1+1", ("answer", "79")),
        ("the calc: 3*4 is not at a line start", None),
        ("just 12", None),
    ],
)
def test_parse_tool_action(text, parsed):
    assert parse_tool_action(text) == parsed


@pytest.mark.parametrize(
    "text,value",
    [
        ("79", 79),
        ("79.", 79),
        ("-2.5 apples", Fraction(-5, 2)),
        ("1/3", Fraction(1, 3)),
        ("1,000", 1000),
        ("about 7 or 8", 7),
        ("seven", None),
    ],
)
def test_parse_answer(text, value):
    assert parse_answer(text) == value


def test_generated_problems_are_consistent_and_fit_the_alphabet():
    rng = random.Random(0)
    seen = set()
    for _ in range(2000):
        problem = generate_problem(rng)
        seen.add(problem.text.split(" ")[0])
        assert set(problem.text) <= set(DEFAULT_ALPHABET) and len(problem.text) <= 100
        values = [evaluate(step) for step in problem.steps]
        assert values[-1] == problem.answer and problem.answer >= 0 and problem.answer.denominator == 1
        for step, value in zip(problem.steps, values):
            assert value.denominator == 1 and value >= 0, step
        assert 2 <= len(problem.steps) <= 3
    assert len(seen) > 5


def test_every_template_is_reachable_and_templates_can_be_chosen():
    rng = random.Random(1)
    env = CalculatorEnv(templates=["wheels"])
    obs, _ = env.reset(seed=0)
    assert obs.startswith("there are ") and "wheels" in obs
    texts = {generate_problem(rng, (name,)).text.split(". ")[-1] for name in TEMPLATES for _ in range(3)}
    assert len(texts) >= len(TEMPLATES)
    with pytest.raises(Exception, match="unknown template 'wheel'"):
        CalculatorEnv(templates=["wheel"])


def test_state_mode_episode_with_the_exact_strings():
    env = CalculatorEnv(templates=["mul_sub"])
    obs, info = env.reset(seed=3)
    problem = env.problem
    calls = [f"calc: {step}" for step in problem.steps]  # a tool's calls are not finite: examples
    assert obs == problem.text + "\n" and info == {"gold_answer": str(problem.answer), "example_actions": calls}
    a, b = problem.steps[0].split("*")
    obs, reward, terminated, truncated, info = checked_step(env, f"calc: {a}*{b}")
    assert obs == f"{problem.text}\ncalc: {a}*{b} = {int(a) * int(b)}\n"
    assert (reward, terminated, truncated, info) == (
        0.0,
        False,
        False,
        {"illegal": False, "action": f"calc: {a}*{b}", "example_actions": calls},
    )
    obs, reward, terminated, truncated, info = checked_step(env, "calc: 1/0")
    assert obs.endswith("calc: 1/0 = error\n") and "division by zero" in info["tool_error"]
    obs, reward, terminated, truncated, info = checked_step(env, f"answer: {problem.answer}")
    assert (reward, terminated, info["outcome"]) == (1.0, True, "win")
    assert set(obs) <= set(DEFAULT_ALPHABET)


def test_wrong_answers_illegal_text_and_the_turn_limit():
    env = CalculatorEnv(max_turns=2, wrong_reward=-0.5, illegal_penalty=-1.0, call_reward=-0.01)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("answer: -1")
    assert (reward, terminated, info["outcome"]) == (-0.5, True, "loss")
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("i do not know")
    assert (reward, terminated, info["illegal"]) == (-1.0, True, True)
    env.reset(seed=0)
    assert env.step("calc: 1+1")[1:4] == (-0.01, False, False)
    _, reward, terminated, truncated, info = env.step("calc: 2+2")
    assert (terminated, truncated, info["outcome"]) == (False, True, "loss")


def test_the_calculator_never_runs_python():
    env = CalculatorEnv()
    env.reset(seed=0)
    obs, _, terminated, _, info = env.step("calc: __import__('os').getcwd()")
    assert obs.endswith("= error\n") and not terminated and "not allowed" in info["tool_error"]


def test_message_mode_for_chat_models():
    env = CalculatorEnv(observation_mode="message")
    messages, info = checked_reset(env, seed=0)
    assert [m["role"] for m in messages] == ["system", "user"] and "calc: EXPRESSION" in messages[0]["content"]
    assert messages[1]["content"] == env.problem.text
    reply, reward, terminated, _, _ = checked_step(env, "Let me compute.\n<calc>6*7</calc>")
    assert reply == [{"role": "tool", "content": "42"}] and not terminated
    reply, reward, terminated, _, info = checked_step(env, f"<answer>{env.problem.answer}</answer>")
    assert reply == [] and terminated and reward == 1.0
    env = CalculatorEnv(observation_mode="message", instructions="", tool_role="user")
    messages, _ = env.reset(seed=0)
    assert [m["role"] for m in messages] == ["user"]
    assert env.step("calc: 7/2")[0] == [{"role": "user", "content": "3.5"}]
    with pytest.raises(Exception, match="observation_mode must be one of state, message"):
        CalculatorEnv(observation_mode="chat")


def test_expert_solves_every_problem_and_is_deterministic():
    env = CalculatorEnv()
    metrics = evaluate_policy(env, expert_policy(env), episodes=200, seed=0)
    assert metrics["env/win_rate"] == 1.0 and 3.0 <= metrics["env/turns_mean"] <= 4.0
    first = [t.observation for t in play_episode(env, expert_policy(env), seed=11).turns]
    assert first == [t.observation for t in play_episode(env, expert_policy(env), seed=11).turns]
    longest = max(
        len(t.observation) + len(t.action)
        for s in range(300)
        for t in play_episode(env, expert_policy(env), seed=s).turns
    )
    assert longest <= 160  # characters of observation + action: a context the tiny model can be built with
