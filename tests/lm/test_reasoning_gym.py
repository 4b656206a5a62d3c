"""reasoning-gym tasks as prompt data (``reasoning_gym:<task>[:options]``): the records and their
prompts, determinism by seed, disjoint train / SFT / held-out problems, options passed through
to reasoning-gym, one-line errors, the task's own verifier through the run's reward path, and
a short ``ppokit train`` on the built-in tiny model."""

from __future__ import annotations

import datetime
import json
import pickle
import sys
import typing
from typing import Literal

import pytest

rg = pytest.importorskip("reasoning_gym")

from resume_helpers import read_rows  # noqa: E402

from ppokit.cli import main  # noqa: E402
from ppokit.config import load_config  # noqa: E402
from ppokit.errors import UserError  # noqa: E402
from ppokit.lm.data import reasoning_gym as rgt  # noqa: E402
from ppokit.lm.data.sources import is_file_source, load_prompts  # noqa: E402
from ppokit.lm.data.tasks import get_task  # noqa: E402
from ppokit.lm.evaluate import score_texts  # noqa: E402
from ppokit.lm.inputs import load_data  # noqa: E402
from ppokit.lm.rewards.functions import load_reward_fn, reward_fields  # noqa: E402
from ppokit.lm.single_turn.workload import reward_scorer  # noqa: E402

CHAIN = "reasoning_gym:chain_sum"


@pytest.fixture(autouse=True)
def fresh_streams():
    """Each test generates its problems anew (the module caches a few problem streams)."""
    rgt._STREAMS.clear()
    yield
    rgt._STREAMS.clear()


def questions(records):
    return [r["reasoning_gym"]["entry"]["question"] for r in records]


# ------------------------------------------------------------------------------ records
def test_records_are_reasoning_gym_problems_with_an_answer_tag_prompt():
    assert not is_file_source(CHAIN) and not is_file_source(f"{CHAIN}:size=5")
    records = load_prompts(f"{CHAIN}:size=40,seed=3", "train")
    assert len(records) == 40
    dataset = rg.create_dataset("chain_sum", seed=3 * 2**20, size=10**6)  # the documented walk of seed 3
    for record in records:
        meta = record["reasoning_gym"]
        entry = meta["entry"]
        assert (meta["task"], meta["seed"], meta["options"]) == ("chain_sum", 3 * 2**20, {})
        assert entry == dataset[meta["index"]]
        assert record["prompt"] == entry["question"] + "\nGive your final answer in <answer> </answer> tags.\n"
        expression = entry["metadata"]["expression"]  # digits, spaces, + and -
        assert set(expression) <= set("0123456789 +-")
        assert record["answer"] == entry["answer"] == str(eval(expression))
        assert pickle.loads(pickle.dumps(record)) == record  # reward workers get it pickled
        json.dumps(record, default=str)  # samples.jsonl
    indices = [r["reasoning_gym"]["index"] for r in records]
    assert indices == sorted(indices) and len(set(indices)) == 40
    sft = load_prompts(f"{CHAIN}:size=40,seed=3", "sft", n=5)
    assert all(r["completion"] == f"<answer>{r['answer']}</answer>" for r in sft)
    task = get_task(CHAIN)
    assert task.default_reward == "reasoning_gym" and len(task.items("eval")) == task.eval_size == 100
    assert len(task.items("train")) == task.size == 2000


def test_problems_are_deterministic_by_seed_and_prefixes():
    first = load_prompts(f"{CHAIN}:size=30,seed=1", "train")
    rgt._STREAMS.clear()  # generated again from scratch
    assert load_prompts(f"{CHAIN}:size=30,seed=1", "train") == first
    assert get_task(f"{CHAIN}:seed=1").items("train", 30) == first  # n given or taken from size
    task = get_task(f"{CHAIN}:seed=1")
    assert task.items("eval", 10) == task.items("eval", 40)[:10]
    other = load_prompts(f"{CHAIN}:size=30,seed=2", "train")
    assert questions(other) != questions(first)
    # nearby seeds walk disjoint blocks of reasoning-gym's generator seeds
    assert {r["reasoning_gym"]["seed"] for r in first} == {2**20}
    assert {r["reasoning_gym"]["seed"] for r in other} == {2 * 2**20}


def test_train_sft_and_held_out_problems_are_disjoint():
    task = get_task(f"{CHAIN}:size=300")
    train, sft, held = (set(questions(task.items(s, n))) for s, n in (("train", None), ("sft", 120), ("eval", 60)))
    assert (len(train), len(sft), len(held)) == (300, 120, 60)  # no repeats within a split
    assert not train & held and not sft & held and not train & sft
    assert all(task.split_of(q) == "eval" for q in held)
    # the held-out problems do not depend on size, and never appear in another seed's training set
    assert set(questions(get_task(f"{CHAIN}:size=20").items("eval", 60))) == held
    for seed in (1, 2):
        assert not set(questions(get_task(f"{CHAIN}:seed={seed}").items("train", 300))) & held
    # the fractions move the cut: a larger held-out share takes problems from the others
    wide = get_task(f"{CHAIN}:eval_fraction=0.5,sft_fraction=0.1")
    assert not set(questions(wide.items("train", 100))) & set(questions(wide.items("eval", 100)))


def test_task_options_reach_reasoning_gym():
    task = get_task(f"{CHAIN}:min_terms=3,max_terms=3,min_digits=2,max_digits=2,allow_negation=false")
    assert task.options == {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2, "allow_negation": False}
    for record in task.items("train", 20):
        meta = record["reasoning_gym"]
        assert meta["options"] == task.options
        assert (meta["entry"]["metadata"]["num_terms"], meta["entry"]["metadata"]["num_digits"]) == (3, 2)
        assert len(meta["entry"]["metadata"]["expression"].split()) == 5  # a op b op c
    natural = get_task("reasoning_gym:basic_arithmetic:operators=+|-,format_style=natural,max_terms=3")
    assert natural.options["operators"] == ["+", "-"] and natural.options["format_style"] == "natural"
    expressions = [r["reasoning_gym"]["entry"]["metadata"]["expression"] for r in natural.items("train", 20)]
    assert all("*" not in e and "/" not in e for e in expressions)
    # keyword arguments are typed already and win over the spec's text
    assert get_task(f"{CHAIN}:min_terms=2,seed=4", min_terms=4, seed=5).options == {"min_terms": 4}
    assert get_task(f"{CHAIN}:seed=4", seed=5).seed == 5
    assert get_task("reasoning_gym", task="chain_sum", size=7).items("train") == get_task(f"{CHAIN}:size=7").items(
        "train"
    )


@pytest.mark.parametrize(
    "text,annotation,value",
    [
        ("3", int, 3),
        ("0.5", float, 0.5),
        ("TRUE", bool, True),
        ("no", bool, False),
        ("none", int | None, None),
        ("7", typing.Optional[int], 7),  # noqa: UP045 - as reasoning-gym's configs write it
        ("x|y", tuple[str, ...], ("x", "y")),
        ("x|y|z", tuple[str], ("x", "y", "z")),
        ("+|*", tuple, ("+", "*")),
        ("0.2|0.8", list[float], [0.2, 0.8]),
        ("natural", Literal["simple", "natural"], "natural"),
        ("2024-02-29", datetime.date, datetime.date(2024, 2, 29)),
        ("none", str | None, None),
    ],
)
def test_option_text_converts_to_the_declared_type(text, annotation, value):
    got = rgt.convert_option(text, annotation, "where")
    assert got == value and type(got) is type(value)


# ------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "spec,pattern",
    [
        (
            "reasoning_gym:chain_sums",
            r"reasoning_gym:chain_sums is not a reasoning-gym task; did you mean 'chain_sum'\? "
            r"\(tasks: ab, .*zebra_puzzles\)",
        ),
        ("reasoning_gym", r"needs a task name: reasoning_gym:<task>"),
        ("reasoning_gym:", r"needs a task name"),
        (
            f"{CHAIN}:min_term=2",
            r"reasoning_gym:chain_sum has no option 'min_term'; did you mean 'min_terms'\? options: size, ",
        ),
        (f"{CHAIN}:min_terms=two", r"min_terms must be an integer \(got 'two'\)"),
        (f"{CHAIN}:allow_negation=maybe", r"allow_negation must be true or false"),
        (f"{CHAIN}:min_terms=0", r"invalid options \(min_terms=0\): AssertionError: min_terms must be positive"),
        (f"{CHAIN}:seed=4096", r"seed must be an integer from 0 to 4095 \(got 4096\)"),
        (f"{CHAIN}:size=0", r"size must be an integer from 1 to"),
        (f"{CHAIN}:size=2.5", r"size must be an integer \(got '2.5'\)"),
        (f"{CHAIN}:eval_fraction=0.6,sft_fraction=0.5", r"leave no problems for training"),
        ("reasoning_gym:basic_arithmetic:format_style=fancy", r"format_style must be one of simple, natural"),
        ("reasoning_gym:arc_agi:board_format_opts=x", r"board_format_opts: a value of type .* cannot be given as text"),
        (f"{CHAIN}:size", r"options must look like name:key=value"),
    ],
)
def test_bad_specs_are_one_line_errors(spec, pattern):
    with pytest.raises(UserError, match=pattern) as info:
        get_task(spec).items("train", 1)
    assert "\n" not in str(info.value)


def test_problem_shortages_and_missing_answers_are_one_line_errors():
    small = f"{CHAIN}:min_terms=2,max_terms=2,max_digits=1,size=500"  # about 200 distinct problems
    with pytest.raises(UserError, match=r"gave only \d+ distinct train problems in the first 50000 of seed 0"):
        load_prompts(small, "train")
    with pytest.raises(UserError, match=r"graph_color has no reference answers .* set data.sft_epochs=0"):
        load_prompts("reasoning_gym:graph_color", "sft", n=2)
    assert load_prompts("reasoning_gym:graph_color", "train", n=2)[0]["answer"] is None  # RL is fine


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now fails
    for call in (lambda: get_task(CHAIN), lambda: load_prompts(f"{CHAIN}:size=3", "train")):
        with pytest.raises(UserError) as info:
            call()
        assert str(info.value) == "reasoning_gym tasks need the optional package: pip install 'ppokit[reasoning]'"


def test_cli_reports_a_bad_task_in_one_line_with_status_2(tmp_path, capsys):
    args = ["train", "arith", "model.path=tiny", f"data.prompts={CHAIN}:min_term=2", "--output-dir", str(tmp_path)]
    assert main([*args, "--no-progress"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and "has no option 'min_term'; did you mean 'min_terms'?" in errors[0]


# ----------------------------------------------------------------------------- verifier
@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum"])
def test_the_tasks_own_verifier_scores_through_the_run_reward_path(task):
    cfg = load_config("arith", [f"data.prompts=reasoning_gym:{task}:size=8", "data.reward=null", "data.eval_size=6"])
    train, held, reward_fn = load_data(cfg)  # as a run reads its inputs
    assert reward_fn.spec == "reasoning_gym" and len(train) == 8 and len(held) == 6
    right = [f"Let me see.\n<answer>{r['answer']}</answer>" for r in held]
    wrong = [f"<answer>{int(r['answer']) + 1}</answer>" for r in held]
    bare = [r["answer"] for r in held]  # right, but not in answer tags
    scorer = reward_scorer(
        cfg.model_copy(update={"data": cfg.data.model_copy(update={"reward_workers": 1})}), reward_fn
    )
    try:  # the run's reward workers: the records go there pickled
        prompts = [r["prompt"] for r in held]
        results = scorer.score(prompts * 3, right + wrong + bare, held * 3)
        assert results.scores == [1.0] * 6 + [0.0] * 12 and results.num_errors == 0
        assert results.notes == [None] * 12 + ["no answer tags"] * 6
        # the held-out accuracy (mean greedy score) uses the same scorer
        assert score_texts(scorer, prompts, right[:3] + wrong[3:], held).scores == [1.0] * 3 + [0.0] * 3
    finally:
        scorer.close()
    # in this process too, as `ppokit reward` and the SFT's held-out check call it
    fields = reward_fields(held[0])
    assert reward_fn(held[0]["prompt"], right[0], **fields) == (1.0, None)
    for example in load_prompts(f"reasoning_gym:{task}:size=8", "sft", n=3):  # the warm start's targets
        assert reward_fn(example["prompt"], example["completion"], **reward_fields(example)) == (1.0, None)
    assert rgt.extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"


def test_a_reward_without_the_field_names_it():
    reward = load_reward_fn("reasoning_gym")
    with pytest.raises(KeyError, match="needs the field"):
        reward.select_fields({"answer": "3"})
    with pytest.raises(ValueError, match="the reasoning_gym field must be a dict"):
        reward("p", "<answer>3</answer>", reasoning_gym="chain_sum")


# ---------------------------------------------------------------------------------- run
@pytest.mark.slow
def test_a_short_run_on_a_reasoning_gym_task(tmp_path):
    args = [
        "train",
        "arith",
        "model.path=tiny",
        f"data.prompts={CHAIN}:size=16,max_terms=2,max_digits=1",
        "data.reward=null",  # the task's own verifier, as without the preset
        "data.sft_epochs=0",
        "data.eval_size=2",
        "data.reward_workers=1",
        "rollout.max_new_tokens=8",
        "train.iterations=2",
        "train.batch_size=4",
        "train.mini_batch_size=4",
        "algo.group_size=2",
        "run.precision=fp32",
        "run.tensorboard=false",
        "run.torch_threads=1",
        "--no-progress",
        "--output-dir",
        str(tmp_path),
        "--name",
        "run",
    ]
    assert main(args) == 0
    rows = read_rows(tmp_path / "run")
    assert len(rows) == 2 and all(row["reward_errors"] == 0 for row in rows) and "eval_accuracy_after" in rows[-1]
    # the tiny model's alphabet has no '<': every response is scored by the verifier as untagged
    assert all(row["reward_notes/no answer tags"] == 4 for row in rows)
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].startswith("State the final answer") and sample["reward_note"] == "no answer tags"
    assert sample["fields"]["reasoning_gym"]["task"] == "chain_sum"
