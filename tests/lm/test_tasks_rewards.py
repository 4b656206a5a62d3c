"""Built-in tasks (disjoint deterministic splits), reward functions, prompt data files."""

from __future__ import annotations

import json
import math
import sys
import warnings

import numpy as np
import pytest

from ppokit.errors import UserError
from ppokit.lm.data.sources import PromptIterator, load_prompts, read_jsonl
from ppokit.lm.data.tasks import ArithmeticTask, get_task
from ppokit.lm.rewards.functions import exact_match, load_reward_fn, numeric_match, parse_first_number, score_responses


# ------------------------------------------------------------------------------ tasks
@pytest.mark.parametrize("digits,op", [(1, "+"), (2, "+"), (2, "-"), (2, "*")])
def test_arithmetic_splits_are_disjoint_and_cover_everything(digits, op):
    task = ArithmeticTask(digits=digits, op=op, seed=3)
    sft, train, held = (set(task.indices(s).tolist()) for s in ("sft", "train", "eval"))
    assert not sft & train and not sft & held and not train & held
    assert len(sft | train | held) == task.num_problems
    for item in task.items("eval", 5) + task.items("train", 5):
        a, b = item["prompt"][:-1].split(op, 1) if op != "-" else item["prompt"][:-1].rsplit("-", 1)
        assert item["prompt"].endswith("=") and set(item) == {"prompt", "answer"}  # no answer in the text
        assert int(item["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert len(a) == len(b) == digits or digits == 1


def test_splits_are_deterministic_prefixes_and_seed_independent_in_membership():
    a, b = ArithmeticTask(seed=0), ArithmeticTask(seed=0)
    assert a.items("sft", 300) == b.items("sft", 300)
    assert a.items("eval", 50) == a.items("eval", 200)[:50]
    other = ArithmeticTask(seed=1)
    assert other.items("eval", 50) != a.items("eval", 50)  # another order...
    assert set(other.indices("eval").tolist()) == set(a.indices("eval").tolist())  # ...same members
    sft_prompts = {x["prompt"] for x in a.items("sft", 2000)}
    assert not sft_prompts & {x["prompt"] for x in other.items("eval", 700)}
    assert not sft_prompts & {x["prompt"] for x in a.items("train")}
    ex = a.items("sft", 1)[0]
    assert set(ex) == {"prompt", "completion", "answer"} and ex["completion"] == ex["answer"]
    assert set(a.items("train", 1)[0]) == {"prompt", "answer"}
    assert (
        700
        < len(
            a.items(
                "eval",
            )
        )
        < 860
        and a.max_answer_length == 3
    )


def test_large_problem_spaces_are_sampled_disjointly():
    task = ArithmeticTask(digits=5, seed=0)
    sft = {x["prompt"] for x in task.items("sft", 500)}
    held = {x["prompt"] for x in task.items("eval", 500)}
    assert len(sft) == 500 and len(held) == 500 and not sft & held
    assert task.items("eval", 100) == task.items("eval", 500)[:100]


def test_task_registry_errors():
    assert get_task("arithmetic", digits=3).digits == 3
    t = get_task("arithmetic:digits=1,op=*")
    assert (t.digits, t.op) == (1, "*")
    with pytest.raises(UserError, match="did you mean 'arithmetic'"):
        get_task("arithmatic")
    with pytest.raises(UserError, match="did you mean 'digits'"):
        get_task("arithmetic", digit=2)
    with pytest.raises(UserError, match="task 'arithmetic' has no option 'zzz'; options: digits, "):
        get_task("arithmetic:zzz=3")
    with pytest.raises(UserError, match="op must be one of"):
        get_task("arithmetic", op="/")
    with pytest.raises(UserError, match="has 13 eval problems"):
        ArithmeticTask(digits=1).items("eval", 100)


# ---------------------------------------------------------------------------- rewards
def test_builtin_rewards_on_hand_cases():
    assert exact_match("1+1=", "2", answer="2") == 1.0
    assert exact_match("1+1=", " 2\n", answer="2") == 1.0
    assert exact_match("1+1=", "22", answer="2") == 0.0
    assert exact_match("1+1=", "", answer="2") == 0.0
    assert numeric_match("", "the answer is 85.", answer="85") == 1.0
    assert numeric_match("", "85.0000001", answer=85) == 1.0
    assert numeric_match("", "5 then -12", answer="-12") == 1.0  # the last number counts
    assert numeric_match("", "1,234", answer="1234") == 1.0
    assert numeric_match("", "84", answer="85") == 0.0
    assert numeric_match("", "no number", answer="85") == 0.0
    assert parse_first_number("x=2e3,") == 2000.0 and parse_first_number("none") is None


def test_load_reward_fn_by_name_module_and_file(tmp_path):
    assert load_reward_fn("exact_match")("p", "2", answer="2") == 1.0
    assert load_reward_fn("ppokit.lm.rewards.functions:numeric_match")("p", "2", answer="2") == 1.0
    path = tmp_path / "my_reward.py"
    path.write_text("def strict(prompt, response, answer):\n    return float(response == answer)\nTHRESHOLD = 3\n")
    fn = load_reward_fn(f"{path}:strict")
    assert fn("p", "7", answer="7", source="extra fields are dropped") == 1.0
    assert score_responses(fn, ["a", "b"], ["7", "8"], [{"answer": "7"}, {"answer": "7"}]) == [1.0, 0.0]


@pytest.mark.parametrize(
    "spec,pattern",
    [
        ("exact_mtch", "did you mean 'exact_match'"),
        ("no_such_pkg_xyz.rewards:fn", "cannot import module 'no_such_pkg_xyz.rewards'"),
        ("ppokit.lm.rewards.functions:exact_mach", "has no attribute 'exact_mach'; did you mean 'exact_match'"),
        ("ppokit.lm.rewards.functions:BUILTIN_REWARDS", "not a function"),
        ("ppokit.lm.rewards.functions:parse_first_number", "must take \\(prompt, response"),
        ("missing/file.py:fn", "does not exist"),
    ],
)
def test_load_reward_fn_errors_name_the_spec(spec, pattern):
    with pytest.raises(UserError, match=pattern) as info:
        load_reward_fn(spec)
    assert spec in str(info.value) and "\n" not in str(info.value)


def test_reward_file_that_fails_to_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("def f(prompt, response:\n    return 1\n")
    with pytest.raises(UserError, match="SyntaxError.*line 1"):
        load_reward_fn(f"{path}:f")


def test_failing_or_bad_rewards_name_the_sample():
    def picky(prompt, response, **fields):
        if response == "boom":
            raise ZeroDivisionError("division by zero")
        return {"nan": math.nan, "text": "1.0", "np": np.float32(0.5)}.get(response, 1.0)

    prompts = ["a", "b", "c"]
    assert score_responses(picky, prompts, ["x", "np", "y"], [{}] * 3) == [1.0, 0.5, 1.0]
    with pytest.raises(UserError, match=r"'.*picky' failed on sample 2 .*ZeroDivisionError: division by zero"):
        score_responses(picky, prompts, ["x", "y", "boom"], [{}] * 3)
    with pytest.raises(UserError, match="returned nan on sample 1"):
        score_responses(picky, prompts, ["x", "nan", "y"], [{}] * 3)
    with pytest.raises(UserError, match="returned str .* on sample 0"):
        score_responses(picky, prompts, ["text", "x", "y"], [{}] * 3)
    with pytest.raises(UserError, match="sample 1 .*needs the field\\(s\\) answer"):
        score_responses("exact_match", ["a", "b"], ["1", "2"], [{"answer": "1"}, {"other": 2}])


# ------------------------------------------------------------------------------- data
def test_jsonl_records_and_errors_name_the_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "2+2=", "answer": "4", "id": 7}\n\n{"prompt": "3+3=", "answer": "6"}\n')
    records = load_prompts(str(good))
    assert records == [{"prompt": "2+2=", "answer": "4", "id": 7}, {"prompt": "3+3=", "answer": "6"}]
    with pytest.raises(UserError, match='line 1: missing "completion"'):
        load_prompts(str(good), "sft")

    cases = {
        "notjson.jsonl": (b'{"prompt": "a"}\n{"prompt": "b",\n', "line 2: not valid JSON"),
        "noprompt.jsonl": (b'{"prompt": "a"}\n{"question": "b"}\n', 'line 2: missing "prompt"'),
        "list.jsonl": (b'["prompt"]\n', "line 1: expected a JSON object"),
        "badtype.jsonl": (b'{"prompt": 5}\n', 'line 1: "prompt" must be a non-empty string'),
        "latin1.jsonl": ('{"prompt": "a"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"), "line 2: not UTF-8"),
        "empty.jsonl": (b"\n  \n", "is empty"),
    }
    for name, (content, pattern) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(UserError, match=pattern) as info:
            read_jsonl(path)
        assert name in str(info.value)
    with pytest.raises(UserError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    assert load_prompts("arithmetic", "eval", n=3, digits=1) == ArithmeticTask(digits=1).items("eval", 3)


def test_prompt_iterator_is_deterministic_and_resumes_exactly():
    items = [{"prompt": str(i)} for i in range(10)]
    it = PromptIterator(items, 4, seed=5)
    first = [[x["prompt"] for x in it.next_batch()] for _ in range(3)]  # crosses an epoch boundary
    assert sorted(sum(first, [])[:10]) == sorted(x["prompt"] for x in items)  # epoch 0 is a permutation
    again = PromptIterator(items, 4, seed=5)
    assert [[x["prompt"] for x in again.next_batch()] for _ in range(3)] == first
    assert [[x["prompt"] for x in PromptIterator(items, 4, seed=6).next_batch()]] != first[:1]
    state = it.state_dict()
    assert json.loads(json.dumps(state)) == state and state["epoch"] == 1 and state["position"] == 2
    expected = [[x["prompt"] for x in it.next_batch()] for _ in range(4)]
    resumed = PromptIterator(items, 4, seed=5)
    resumed.load_state_dict(state)
    assert [[x["prompt"] for x in resumed.next_batch()] for _ in range(4)] == expected
    with pytest.raises(UserError, match="prompt data changed"):
        PromptIterator(items[:9], 4, seed=5).load_state_dict(state)
    assert [x["prompt"] for x in PromptIterator(items, 3, shuffle=False).next_batch()] == ["0", "1", "2"]


def test_rewards_that_overflow_or_exit_are_user_errors(tmp_path):
    def huge(prompt, response, **fields):
        return 10**400

    def exits(prompt, response, **fields):
        sys.exit(3)

    with pytest.raises(UserError, match="'.*huge' returned a number too large for a float on sample 0"):
        score_responses(huge, ["a"], ["x"], [{}])
    with pytest.raises(UserError, match=r"'.*exits' failed on sample 0 .*it called sys.exit\(3\)"):
        score_responses(exits, ["a"], ["x"], [{}])
    path = tmp_path / "exits_at_import.py"
    path.write_text("import sys\nsys.exit(1)\ndef f(prompt, response):\n    return 1.0\n")
    with pytest.raises(UserError, match=r"running .*exits_at_import.py failed: it called sys.exit\(1\)"):
        load_reward_fn(f"{path}:f")
    module = tmp_path / "exits_module_xyz.py"
    module.write_text("raise SystemExit(2)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(UserError, match=r"importing 'exits_module_xyz' failed: it called sys.exit\(2\)"):
            load_reward_fn("exits_module_xyz:f")
    finally:
        sys.path.remove(str(tmp_path))


def test_keyword_only_and_async_rewards_are_refused_up_front():
    def kwonly(*, prompt, response):
        return 0.0

    async def coro(prompt, response, **fields):
        return 1.0

    with pytest.raises(
        UserError,
        match=r"prompt and response as its first two positional parameters; "
        r"it takes \(\*, prompt, response\)",
    ):
        load_reward_fn(kwonly)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine was never awaited"
        with pytest.raises(UserError, match="is an async def; .* make it a plain def"):
            load_reward_fn(coro)


def test_a_prompt_file_field_named_response_is_refused(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "answer": "3", "response": "x"}\n')
    with pytest.raises(UserError, match='data.jsonl line 2: the field "response" is reserved.*rename the field'):
        load_prompts(str(path))
