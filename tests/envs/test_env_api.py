"""The text-environment API: registry, loading user environments, validated calls, failures."""

import textwrap

import pytest

from ppokit.envs import (
    EnvError,
    StepResult,
    TextEnv,
    TextEnvProtocol,
    check_failure_rate,
    checked_reset,
    checked_step,
    env_names,
    make_env,
    register_env,
    step_or_fail,
)
from ppokit.errors import UserError


def _one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- registry
def test_builtins_and_aliases_build():
    assert env_names() == ("tictactoe", "frozenlake", "guess_number", "calculator")
    for name in (
        "tictactoe",
        "tic-tac-toe",
        "frozenlake",
        "frozen-lake",
        "guess_number",
        "guess",
        "calculator",
        "calc",
    ):
        env = make_env(name)
        assert isinstance(env, TextEnv) and isinstance(env, TextEnvProtocol)
        obs, info = checked_reset(env, seed=0)
        assert isinstance(obs, str) and isinstance(info, dict)
    assert make_env("calc").env_name == "calculator"


def test_unknown_name_suggests_the_closest():
    with pytest.raises(EnvError) as exc:
        make_env("tictactoo")
    message = _one_line(exc)
    assert "unknown environment 'tictactoo'; did you mean 'tictactoe'?" in message
    assert "module:Class or path/to/file.py:Class" in message
    with pytest.raises(EnvError, match="unknown environment 'zzz'; built-ins: tictactoe, frozenlake"):
        make_env("zzz")
    assert issubclass(EnvError, UserError)  # the CLI prints it on one line, exit status 2


def test_unknown_keyword_suggests_the_closest_parameter():
    with pytest.raises(EnvError) as exc:
        make_env("tictactoe", oponent="random")
    message = _one_line(exc)
    assert "environment 'tictactoe' does not take 'oponent'; did you mean 'opponent'?" in message
    assert "policy_seat" in message

    class NoOptions:
        def reset(self, seed=None):
            return "", {}

        def step(self, action):
            return "", 0.0, True, False, {}

    with pytest.raises(EnvError, match="environment '.*NoOptions' does not take 'level'; parameters: none"):
        make_env(NoOptions, level=2)


def test_bad_builtin_option_is_a_user_error():
    with pytest.raises(UserError, match="unknown opponent 'heuristc'; did you mean 'heuristic'"):
        make_env("tictactoe", opponent="heuristc")
    with pytest.raises(UserError, match="max_guesses must be at least 1"):
        make_env("guess", max_guesses=0)


def test_register_env_rejects_duplicates_and_colons():
    with pytest.raises(ValueError, match="already registered"):
        register_env("tictactoe", TextEnv)
    with pytest.raises(ValueError, match="without ':'"):
        register_env("a:b", TextEnv)


# ----------------------------------------------------------------------------- user environments
USER_ENV = textwrap.dedent('''
    class Echo:
        """Episode of two turns; reward 1 when the action says 'yes'."""
        def __init__(self, word="yes"):
            self.word = word
        def reset(self, seed=None):
            self.t = 0
            return "say " + self.word, {}
        def step(self, action):
            self.t += 1
            return "again", float(self.word in action), self.t >= 2, False, {}

    class NoStep:
        def reset(self, seed=None):
            return "", {}

    NOT_A_CLASS = 3
''')


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_envs.py"
    path.write_text(USER_ENV)
    return path


def test_user_environment_from_a_file_and_a_module(user_file, monkeypatch):
    env = make_env(f"{user_file}:Echo", word="ok")
    obs, info = checked_reset(env, seed=1)
    assert obs == "say ok"
    assert checked_step(env, "ok!") == StepResult("again", 1.0, False, False, {})
    assert env.env_name == f"{user_file}:Echo"
    monkeypatch.syspath_prepend(str(user_file.parent))
    env = make_env("my_envs:Echo")
    assert checked_reset(env)[0] == "say yes"


@pytest.mark.parametrize(
    "suffix,expected",
    [
        (":Ecko", "has no attribute 'Ecko'; did you mean 'Echo'?"),
        (":NOT_A_CLASS", "NOT_A_CLASS is a int, not a class"),
        (":NoStep", "built a NoStep without step"),
    ],
)
def test_user_environment_mistakes_are_one_line(user_file, suffix, expected):
    with pytest.raises(EnvError) as exc:
        make_env(f"{user_file}{suffix}")
    assert expected in _one_line(exc)


def test_user_environment_file_and_module_problems(tmp_path):
    with pytest.raises(EnvError, match=r"file .*missing\.py does not exist"):
        make_env(f"{tmp_path}/missing.py:Env")
    broken = tmp_path / "broken.py"
    broken.write_text("class Env:\n    def reset(self\n")
    with pytest.raises(EnvError) as exc:
        make_env(f"{broken}:Env")
    assert "running" in _one_line(exc) and "SyntaxError" in str(exc.value) and "(line 2)" in str(exc.value)
    with pytest.raises(EnvError, match=r"cannot import module 'no_such_pkg_xyz\.envs' \(no module named 'no_such_pkg"):
        make_env("no_such_pkg_xyz.envs:Env")
    failing = tmp_path / "failing.py"
    failing.write_text(
        "class Env:\n    def __init__(self):\n        raise RuntimeError('no licence key\\nmore')\n"
        "    def reset(self, seed=None): pass\n    def step(self, a): pass\n"
    )
    with pytest.raises(EnvError) as exc:
        make_env(f"{failing}:Env")
    assert _one_line(exc).endswith("building it failed: RuntimeError: no licence key")


# ----------------------------------------------------------------------------- validated calls
class Scripted(TextEnv):
    """Returns whatever the test puts in ``out``."""

    def __init__(self, reset_out=("obs", {}), step_out=("obs", 0.0, False, False, {})):
        super().__init__()
        self.reset_out, self.step_out = reset_out, step_out

    def reset(self, seed=None, options=None):
        self._seed(seed)
        return self.reset_out

    def step(self, action):
        if isinstance(self.step_out, BaseException):
            raise self.step_out
        return self.step_out


@pytest.mark.parametrize(
    "step_out,expected",
    [
        ((3, 0.0, False, False, {}), "step returned a int (3) as the observation; return a str or a list"),
        (([{"role": "user"}], 0.0, False, False, {}), "message 0 has no string 'content'"),
        ((["hi"], 0.0, False, False, {}), "item 0 is a str ('hi'), not a message"),
        (("o", "1", False, False, {}), "step returned str '1' as the reward"),
        (("o", True, False, False, {}), "returned bool True as the reward"),
        (("o", float("nan"), False, False, {}), "the reward nan; rewards must be finite"),
        (("o", 0.0, 1, False, {}), "returned 1 as terminated; return True or False"),
        (
            ("o", 0.0, False, False),
            "step returned a 4-tuple; return (observation, reward, terminated, truncated, info)",
        ),
        (("o", 0.0, False, False, None), "returned a NoneType (None) as info; return a dict"),
        (("o", 0.0, True, False, {"outcome": "won"}), "info['outcome'] is 'won'; use one of win, draw, loss"),
        (("o", 0.0, False, False, {"illegal": "yes"}), "info['illegal'] is 'yes'"),
        (("o", 0.0, False, False, {"player": "x"}), "info['player'] is 'x'"),
    ],
)
def test_bad_step_returns_name_the_environment_and_what_came_back(step_out, expected):
    env = Scripted(step_out=step_out)
    with pytest.raises(EnvError) as exc:
        checked_step(env, "a", name="mine")
    message = _one_line(exc)
    assert message.startswith("environment 'mine' ")
    assert expected in message


def test_bad_reset_returns():
    with pytest.raises(EnvError, match=r"environment 'Scripted' reset returned 'obs'; return \(observation, info\)"):
        checked_reset(Scripted(reset_out="obs"))
    with pytest.raises(EnvError, match="reset returned a dict"):
        checked_reset(Scripted(reset_out=({"role": "user", "content": "x"}, {})))


def test_valid_returns_pass_through_with_numpy_and_message_lists():
    np = pytest.importorskip("numpy")
    messages = [{"role": "tool", "content": "42"}]
    info = {"outcome": "win", "player": np.int64(1)}
    env = Scripted(step_out=(messages, np.float32(0.5), np.bool_(True), False, info))
    result = checked_step(env, "a")
    assert result == StepResult(messages, 0.5, True, False, {"outcome": "win", "player": 1})
    assert type(result.reward) is float and type(result.terminated) is bool and result.done and not result.failed
    assert checked_step(Scripted(step_out=([], 0.0, False, False, {})), "a").observation == []


def test_reset_passes_options_only_when_given():
    class SeedOnly:
        def reset(self, seed=None):
            return f"seed {seed}", {}

        def step(self, action):
            return "", 0.0, True, False, {}

    assert checked_reset(SeedOnly(), seed=4) == ("seed 4", {})
    with pytest.raises(EnvError, match=r"reset\(seed=4\) failed: TypeError"):
        checked_reset(SeedOnly(), seed=4, options={"seat": 1})


def test_an_exception_inside_step_ends_the_episode_as_a_counted_failure():
    env = Scripted(step_out=ValueError("tool server down\ntraceback..."))
    with pytest.raises(ValueError):
        checked_step(env, "a")
    result = step_or_fail(env, "a", failure_reward=-0.5)
    assert result == StepResult("", -0.5, True, False, {"env_error": "ValueError: tool server down"})
    assert result.failed and result.done
    # contract violations and interrupts are not swallowed
    with pytest.raises(EnvError):
        step_or_fail(Scripted(step_out=(1, 0.0, False, False, {})), "a")
    with pytest.raises(KeyboardInterrupt):
        step_or_fail(Scripted(step_out=KeyboardInterrupt()), "a")


def test_failure_rate_guard():
    check_failure_rate(1, 10, max_rate=0.1, env_name="calc")
    with pytest.raises(EnvError) as exc:
        check_failure_rate(2, 10, max_rate=0.1, env_name="calc", first_error="ValueError: boom")
    assert _one_line(exc) == (
        "environment 'calc' failed in 2 of 10 episodes (first: ValueError: boom); fix the "
        "environment, or allow more failures than 0.1 of the episodes"
    )


def test_seeding_follows_gymnasium():
    env = Scripted()
    env.reset(seed=3)
    a = env.rng.random()
    env.reset(seed=3)
    assert env.rng.random() == a
    env.reset()  # no seed: the stream goes on
    assert env.rng.random() != a
    with pytest.raises(TypeError, match="seed must be an int"):
        env.reset(seed="3")
