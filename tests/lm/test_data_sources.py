"""Prompt data from JSONL, Parquet and datasets directories; key mapping; the long-prompt filter;
PromptIterator over several epochs and its exact resume (mid-epoch and at an epoch boundary)."""

from __future__ import annotations

import json

import pytest

from ppokit.errors import UserError
from ppokit.lm.data.sources import PromptIterator, drop_long_prompts, is_file_source, load_prompts

datasets = pytest.importorskip("datasets")

ROWS = [
    {"question": "2+2=", "solution": "4", "tests": ["assert f() == 4"], "level": 1},
    {"question": "3+3=", "solution": "6", "tests": [], "level": 2},
]
EXPECTED = [
    {"prompt": "2+2=", "answer": "4", "tests": ["assert f() == 4"], "level": 1},
    {"prompt": "3+3=", "answer": "6", "tests": [], "level": 2},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_parquet_and_saved_datasets_give_the_same_records(tmp_path):
    keys = dict(prompt_key="question", answer_key="solution")
    jsonl = _jsonl(tmp_path / "data.jsonl", ROWS)
    parquet = tmp_path / "data.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
    for source in (jsonl, str(parquet), str(saved)):
        assert is_file_source(source)
        assert load_prompts(source, **keys) == EXPECTED, source
    assert load_prompts(str(parquet), n=1, **keys) == EXPECTED[:1]


def test_a_dataset_dict_directory_gives_its_train_and_test_splits(tmp_path):
    train = [{"prompt": f"t{i}", "answer": str(i)} for i in range(3)]
    test = [{"prompt": "held out", "answer": "9"}]
    saved = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)}
    ).save_to_disk(str(saved))
    assert load_prompts(str(saved), "train") == train
    assert load_prompts(str(saved), "eval") == test
    only_train = tmp_path / "only_train"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train)}).save_to_disk(str(only_train))
    with pytest.raises(UserError, match="has the splits train, none of them a eval split"):
        load_prompts(str(only_train), "eval")


def test_default_keys_and_every_other_column_is_a_field(tmp_path):
    parquet = tmp_path / "plain.parquet"
    datasets.Dataset.from_list([{"prompt": "p", "answer": "a", "extra": {"k": [1, 2]}}]).to_parquet(str(parquet))
    assert load_prompts(str(parquet)) == [{"prompt": "p", "answer": "a", "extra": {"k": [1, 2]}}]


def test_errors_name_the_file_and_the_row_or_line(tmp_path):
    parquet = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([{"q": "ok"}, {"q": ""}]).to_parquet(str(parquet))
    with pytest.raises(UserError, match=r'rows.parquet row 1: "q" must be a non-empty string'):
        load_prompts(str(parquet), prompt_key="q")
    with pytest.raises(UserError, match=r'rows.parquet: no column "prompt" \(columns: q\); set the prompt column'):
        load_prompts(str(parquet))
    with pytest.raises(UserError, match=r'no column "completion"'):
        load_prompts(str(parquet), "sft", prompt_key="q")
    reserved = tmp_path / "reserved.parquet"
    datasets.Dataset.from_list([{"prompt": "p", "response": "r"}]).to_parquet(str(reserved))
    with pytest.raises(UserError, match='reserved.parquet row 0: the field "response" is reserved'):
        load_prompts(str(reserved))
    both = _jsonl(tmp_path / "both.jsonl", [{"question": "q", "prompt": "p"}])
    with pytest.raises(UserError, match='both.jsonl line 1: has both "question" and "prompt"'):
        load_prompts(both, prompt_key="question")
    missing = _jsonl(tmp_path / "missing.jsonl", [{"prompt": "p"}, {"question": "q"}])
    with pytest.raises(UserError, match='missing.jsonl line 1: missing "question"'):
        load_prompts(missing, prompt_key="question")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(UserError, match="cannot read .*broken.parquet as a Parquet file"):
        load_prompts(str(broken))
    plain_dir = tmp_path / "plain_dir"
    plain_dir.mkdir()
    with pytest.raises(UserError, match="plain_dir is not a file, and not a directory written by datasets"):
        load_prompts(str(plain_dir))
    empty = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict({"prompt": []}).to_parquet(str(empty))
    with pytest.raises(UserError, match="empty.parquet has no rows"):
        load_prompts(str(empty))


def test_task_specs_with_paths_are_tasks_not_files():
    assert not is_file_source("arithmetic")
    assert not is_file_source("arithmetic:digits=2")
    assert not is_file_source("gsm8k:path=data/train.jsonl")
    assert is_file_source("data/train.jsonl") and is_file_source("x.parquet")


def test_drop_long_prompts_keeps_order_and_counts():
    records = [{"prompt": "a" * n, "i": i} for i, n in enumerate([3, 10, 5, 11, 1])]
    kept, dropped = drop_long_prompts(records, 5, count_tokens=lambda texts: [len(t) for t in texts])
    assert [r["i"] for r in kept] == [0, 2, 4] and dropped == 2
    with pytest.raises(UserError, match="all 5 prompts are longer than 0 tokens|positive integer"):
        drop_long_prompts(records, 0, count_tokens=lambda texts: [len(t) for t in texts])
    with pytest.raises(UserError, match=r"all 2 prompts are longer than 2 tokens \(the shortest has 3\)"):
        drop_long_prompts(records[:2], 2, count_tokens=lambda texts: [len(t) for t in texts])


def test_drop_long_prompts_with_a_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = [{"prompt": "12+3="}, {"prompt": "1" * 40}]
    lengths = [len(tokenizer(r["prompt"])["input_ids"]) for r in records]
    kept, dropped = drop_long_prompts(records, lengths[0], tokenizer=tokenizer)
    assert kept == records[:1] and dropped == 1


# ---------------------------------------------------------------------------- epochs
def _prompts(batch):
    return [x["prompt"] for x in batch]


@pytest.mark.parametrize("num_items,batch_size", [(12, 4), (10, 4), (7, 7), (5, 8)])
def test_every_epoch_is_a_seeded_permutation(num_items, batch_size):
    items = [{"prompt": str(i)} for i in range(num_items)]
    it = PromptIterator(items, batch_size, seed=3)
    drawn = sum((_prompts(it.next_batch()) for _ in range(4 * num_items)), [])  # 4 * batch_size epochs
    epochs = [drawn[e * num_items : (e + 1) * num_items] for e in range(len(drawn) // num_items)]
    assert all(sorted(e, key=int) == [str(i) for i in range(num_items)] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled each epoch
    again = PromptIterator(items, batch_size, seed=3)
    assert sum((_prompts(again.next_batch()) for _ in range(4 * num_items)), []) == drawn
    other = PromptIterator(items, batch_size, seed=4)
    assert sum((_prompts(other.next_batch()) for _ in range(4 * num_items)), []) != drawn


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5, 6, 9])
def test_resume_continues_the_same_order_and_step_count(stop_after):
    """12 items in batches of 4: epochs end after batches 3, 6, 9 (the boundary cases) and
    1, 2, 5 stop mid-epoch. The resumed iterator yields the uninterrupted one's batches."""
    items = [{"prompt": str(i)} for i in range(12)]
    total = 15
    straight = PromptIterator(items, 4, seed=11)
    expected = [_prompts(straight.next_batch()) for _ in range(total)]

    first = PromptIterator(items, 4, seed=11)
    got = [_prompts(first.next_batch()) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    assert all(type(state[k]) is int for k in ("epoch", "position"))
    if stop_after % 3 == 0:
        assert (state["epoch"], state["position"]) == (stop_after // 3, 0)
    resumed = PromptIterator(items, 4, seed=11)
    resumed.load_state_dict(state)
    assert resumed.batches_drawn == stop_after
    got += [_prompts(resumed.next_batch()) for _ in range(total - stop_after)]
    assert got == expected
    assert resumed.batches_drawn == total


def test_a_state_written_at_the_end_of_an_epoch_starts_the_next_one():
    """A state that says "position == number of items" (the end of the epoch, as other
    iterators store it) resumes with the next epoch's first batch, never an empty epoch."""
    items = [{"prompt": str(i)} for i in range(8)]
    straight = PromptIterator(items, 4, seed=2)
    expected = [_prompts(straight.next_batch()) for _ in range(6)]
    resumed = PromptIterator(items, 4, seed=2)
    resumed.load_state_dict({**resumed.state_dict(), "epoch": 0, "position": 8})
    assert [_prompts(resumed.next_batch()) for _ in range(4)] == expected[2:]
    with pytest.raises(ValueError, match="corrupt"):
        resumed.load_state_dict({**resumed.state_dict(), "position": 9})
