"""Built-in tasks: Countdown (deterministic disjoint splits, a verifier on exact arithmetic) and
GSM8K-format files (question -> prompt, the number after #### -> answer), through load_prompts."""

from __future__ import annotations

import json

import pytest

from ppokit.errors import UserError
from ppokit.lm.data.countdown import CountdownTask, countdown_reward, extract_expression
from ppokit.lm.data.gsm8k import gsm8k_final_answer
from ppokit.lm.data.sources import is_file_source, load_prompts
from ppokit.lm.data.tasks import get_task
from ppokit.lm.rewards.functions import load_reward_fn


# -------------------------------------------------------------------------- countdown
def test_countdown_splits_are_deterministic_disjoint_and_solvable():
    task = CountdownTask(seed=0, train_size=600)
    keys = {
        s: {(tuple(sorted(x["numbers"])), x["target"]) for x in task.items(s, None if s == "train" else 200)}
        for s in ("train", "sft", "eval")
    }
    assert len(keys["train"]) == 600 and len(keys["eval"]) == 200
    assert not keys["train"] & keys["eval"] and not keys["sft"] & keys["eval"] and not keys["train"] & keys["sft"]
    assert CountdownTask(seed=0).items("eval", 50) == task.items("eval", 200)[:50]  # prefixes, repeatable
    other = CountdownTask(seed=1)
    assert other.items("eval", 50) != task.items("eval", 50)
    assert not {(tuple(sorted(x["numbers"])), x["target"]) for x in other.items("train", 600)} & keys["eval"]
    for item in task.items("train", 300) + task.items("eval", 100):
        assert len(item["numbers"]) == 4 and all(1 <= x <= 100 for x in item["numbers"])
        assert 1 <= item["target"] <= 1000 and str(item["numbers"]) in item["prompt"]
        assert countdown_reward(
            item["prompt"], f"<answer>{item['answer']}</answer>", numbers=item["numbers"], target=item["target"]
        ) == (1.0, None)
    sft = task.items("sft", 3)
    assert all(x["completion"] == f"<answer>{x['answer']}</answer>" for x in sft)


@pytest.mark.parametrize(
    "response,score,reason",
    [
        ("<answer>(25 - 5) * 3 / 4</answer>", 1.0, None),
        ("I think...\n(25-5)*3/4 = 15\n", 1.0, None),  # last line, "= value" dropped
        ("I think... (25-5)*3/4 = 15", 0.0, "not an arithmetic expression"),
        ("<answer>20*3/4</answer>", 0.0, "uses numbers not given"),
        ("<answer>25 - 5 - 5</answer>", 0.0, "uses numbers not given"),  # 5 twice, given once
        ("<answer>25 + 3</answer>", 0.0, "wrong value"),
        ("<answer>(25 - 5) * 3 // 4</answer>", 0.0, "operator not allowed"),
        ("<answer>25 ** 2</answer>", 0.0, "operator not allowed"),
        ("<answer>__import__('os')</answer>", 0.0, "not an arithmetic expression"),
        ("<answer>3 / (5 - 5)</answer>", 0.0, "not an arithmetic expression"),  # division by zero
        ("", 0.0, "no expression"),
        ("<answer>3 * 5</answer>", 1.0, None),  # at most once: not all needed
        ("<answer>4*5 - 25/5</answer>", 0.0, "uses numbers not given"),
    ],
)
def test_countdown_verifier(response, score, reason):
    got, why = countdown_reward("p", response, numbers=[25, 5, 3, 4], target=15)
    assert got == score and (why is None if reason is None else why.startswith(reason))


def test_countdown_is_registered_with_its_reward():
    assert not is_file_source("countdown")
    task = get_task("countdown:num_count=3,max_number=20")
    assert task.default_reward == "countdown" and (task.num_count, task.max_number) == (3, 20)
    records = load_prompts("countdown:num_count=3", "eval", n=5)
    reward = load_reward_fn("countdown")
    assert [reward(r["prompt"], r["answer"], **{k: v for k, v in r.items() if k != "prompt"})[0] for r in records] == [
        1.0
    ] * 5
    assert extract_expression("a\n<answer>1+2</answer>\n<answer> 3+4 = 7 </answer>") == "3+4"
    with pytest.raises(UserError, match="num_count must be an integer >= 2"):
        get_task("countdown", num_count=1)


# ------------------------------------------------------------------------------ gsm8k
GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {
        "question": "A shop sells 1,200 pens a day. How many in 3 days?",
        "answer": "1,200 * 3 = <<1200*3=3600>>3,600\n#### 3,600",
    },
    {"question": "It was 5 degrees and fell by 8. What is it now?", "answer": "5 - 8 = -3\n#### -3"},
]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_gsm8k_file_gives_question_prompts_and_final_answers(tmp_path):
    train = _write(tmp_path / "train.jsonl", GSM8K)
    test = _write(tmp_path / "test.jsonl", GSM8K[:1])
    spec = f"gsm8k:path={train},eval_path={test}"
    assert not is_file_source(spec)
    records = load_prompts(spec, "train")
    assert [r["prompt"] for r in records] == [g["question"] for g in GSM8K]
    assert [r["answer"] for r in records] == ["72", "3600", "-3"]
    assert "<<" not in records[0]["solution"] and records[0]["solution"].endswith("#### 72")
    assert load_prompts(spec, "eval") == records[:1]
    sft = load_prompts(spec, "sft", n=2)
    assert [r["completion"] for r in sft] == [r["solution"] for r in records[:2]]
    assert get_task(spec).default_reward == "math"
    for reward in ("numeric_match", "math"):
        fn = load_reward_fn(reward)
        assert fn(records[0]["prompt"], "48 + 24 = 72 clips. #### 72", answer=records[0]["answer"]) == 1.0
        assert fn(records[1]["prompt"], "So \\boxed{3600}", answer=records[1]["answer"]) == 1.0
        assert fn(records[2]["prompt"], "The answer is \\boxed{3}", answer=records[2]["answer"]) == 0.0


def test_gsm8k_without_an_eval_file_holds_out_a_fixed_part(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(200)]
    path = _write(tmp_path / "train.jsonl", rows)
    train = load_prompts(f"gsm8k:path={path}", "train")
    held = load_prompts(f"gsm8k:path={path}", "eval")
    assert len(train) + len(held) == 200 and 5 <= len(held) <= 40
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}


def test_gsm8k_errors(tmp_path):
    bad = _write(tmp_path / "bad.jsonl", [GSM8K[0], {"question": "q", "answer": "no mark here"}])
    with pytest.raises(UserError, match=r"bad.jsonl record 2: the answer must end with '#### N'"):
        load_prompts(f"gsm8k:path={bad}")
    missing = _write(tmp_path / "missing.jsonl", [{"prompt": "q", "answer": "#### 1"}])
    with pytest.raises(UserError, match='missing.jsonl line 1: missing "question"'):
        load_prompts(f"gsm8k:path={missing}")
    with pytest.raises(UserError, match="task gsm8k needs the data file"):
        get_task("gsm8k")
    assert gsm8k_final_answer("x\n#### 1,234.") == "1234" and gsm8k_final_answer("#### abc") is None
