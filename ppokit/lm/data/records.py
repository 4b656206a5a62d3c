"""Reading prompt records from a user's file: JSONL, Parquet, or a ``datasets`` directory.

A record is a dict with a ``"prompt"`` and any other fields; the other fields go to the
reward function. Three kinds of source hold records:

- a JSONL file (``.jsonl``, ``.json``, ``.jsonlines``, ``.ndjson``, or any other file):
  one JSON object per non-blank line, read here line by line so that an error names the
  file and the line;
- a Parquet file (``.parquet``, ``.pq``): one record per row, read with the Hugging Face
  ``datasets`` library;
- a directory written by ``datasets.Dataset.save_to_disk`` (one dataset) or
  ``DatasetDict.save_to_disk`` (named splits: ``train`` for training, ``test``,
  ``validation``, ``eval`` or ``valid`` for the held-out split).

Columns are mapped by name: ``prompt_key`` (default ``"prompt"``) becomes the record's
``"prompt"`` and ``answer_key`` (default ``"answer"``) its ``"answer"`` field (the one the
verifiers read); every other column is passed to the reward function under its own name.
``datasets`` is imported only when a Parquet file or a dataset directory is read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ppokit.errors import UserError
from ppokit.lm.data.chat import message_problem

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonlines", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
# The reward function is called as fn(prompt, response, **fields): no field may be named response
# (a "prompt" key is the record's prompt itself and is not passed as a field).
RESERVED_FIELD = "response"
# A DatasetDict's split names for each of ppokit's splits, in order of preference.
DATASET_SPLITS = {
    "train": ("train",),
    "sft": ("sft", "train"),
    "eval": ("test", "validation", "eval", "valid", "heldout"),
}
# Files that datasets' save_to_disk writes: state.json for a Dataset, dataset_dict.json for a DatasetDict.
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")


def read_records(
    source: str | Path,
    *,
    split: str = "train",
    require: Sequence[str] = ("prompt",),
    chat: bool = False,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> list[dict[str, Any]]:
    """Records of a JSONL file, a Parquet file or a ``save_to_disk`` directory (module docstring).

    ``split`` picks a split of a ``DatasetDict`` directory (a file is one split). Every key
    in ``require`` (after mapping) must hold a non-empty string, except that with ``chat``
    a ``"prompt"`` may also be a list of chat messages.
    """
    path = Path(source)
    if path.is_dir():
        return _read_dataset_dir(
            path, split=split, require=require, chat=chat, prompt_key=prompt_key, answer_key=answer_key
        )
    if path.suffix.lower() in PARQUET_SUFFIXES:
        return _read_parquet(path, require=require, chat=chat, prompt_key=prompt_key, answer_key=answer_key)
    return read_jsonl(path, require=require, chat=chat, prompt_key=prompt_key, answer_key=answer_key)


# ------------------------------------------------------------------------------ JSONL
def read_jsonl(
    path: str | Path,
    *,
    require: Sequence[str] = ("prompt",),
    chat: bool = False,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> list[dict[str, Any]]:
    """Records of a JSONL file; every field in ``require`` must be a non-empty string, except
    that with ``chat`` a ``"prompt"`` may also be a list of chat messages."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"prompt file {path} does not exist" if not path.exists() else f"prompt file {path} is not a file"
        )
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None
    records = []
    for number, line in enumerate(raw.splitlines(), start=1):
        try:
            text = line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(
                f"{path} line {number}: not UTF-8 text (byte {exc.start + 1}); save the file as UTF-8"
            ) from None
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            if path.suffix.lower() not in JSONL_SUFFIXES:
                raise UserError(
                    f"{path}: prompt files are JSONL (one JSON object per line, e.g. data.jsonl), "
                    f"Parquet (.parquet) or a datasets save_to_disk directory; this "
                    f"{path.suffix or 'extension-less'} file is not JSONL (line {number}: {exc.msg})"
                ) from None
            raise UserError(
                f"{path} line {number}: not valid JSON ({exc.msg} at column {exc.colno}); "
                f'each line must be one object like {{"{prompt_key}": "..."}}'
            ) from None
        if not isinstance(record, dict):
            raise UserError(
                f'{path} line {number}: expected a JSON object like {{"{prompt_key}": "..."}}, '
                f"got a {type(record).__name__}"
            )
        records.append(
            check_record(
                record,
                f"{path} line {number}",
                require=require,
                chat=chat,
                prompt_key=prompt_key,
                answer_key=answer_key,
            )
        )
    if not records:
        raise UserError(
            f"{path} is empty: it needs one JSON object per line, each with "
            + " and ".join(f'"{_source_key(k, prompt_key, answer_key)}"' for k in require)
        )
    return records


# --------------------------------------------------------------------------- datasets
def _read_parquet(path: Path, **check: Any) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UserError(
            f"prompt file {path} does not exist" if not path.exists() else f"prompt file {path} is not a file"
        )
    datasets = _import_datasets(path)
    import pyarrow.parquet

    try:  # the footer first: a clear error for a damaged or empty file
        rows = pyarrow.parquet.ParquetFile(str(path)).metadata.num_rows
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors for a damaged or non-Parquet file
        raise UserError(f"cannot read {path} as a Parquet file: {_first_line(exc)}") from None
    if rows == 0:
        raise UserError(f"{path} has no rows")
    try:
        dataset = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors for a damaged or non-Parquet file
        raise UserError(f"cannot read {path} as a Parquet file: {_first_line(exc)}") from None
    return _dataset_records(dataset, str(path), **check)


def _read_dataset_dir(path: Path, *, split: str, **check: Any) -> list[dict[str, Any]]:
    if not any((path / name).is_file() for name in SAVED_DATASET_MARKERS):
        raise UserError(
            f"prompt file {path} is not a file, and not a directory written by datasets' "
            f"save_to_disk (it has no {' or '.join(SAVED_DATASET_MARKERS)}); give a JSONL or Parquet "
            "file, or such a directory"
        )
    datasets = _import_datasets(path)
    try:
        loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as exc:  # noqa: BLE001 - a damaged save_to_disk directory
        raise UserError(
            f"cannot load the dataset directory {path}: {_first_line(exc)}; write it again with save_to_disk"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        names = [name for name in DATASET_SPLITS.get(split, (split,)) if name in loaded]
        if not names:
            raise UserError(
                f"{path} has the splits {', '.join(loaded) or 'none'}, none of them a {split} split "
                f"({' or '.join(DATASET_SPLITS.get(split, (split,)))}); rename a split or point at "
                "a single dataset"
            )
        return _dataset_records(loaded[names[0]], f"{path} (split {names[0]})", **check)
    return _dataset_records(loaded, str(path), **check)


def _dataset_records(
    dataset, where: str, *, require: Sequence[str], chat: bool, prompt_key: str, answer_key: str
) -> list[dict[str, Any]]:
    columns = list(dataset.column_names)
    for key in require:
        column = _source_key(key, prompt_key, answer_key)
        if column not in columns:
            raise UserError(
                f'{where}: no column "{column}" (columns: {", ".join(columns) or "none"})'
                + ("; set the prompt column's name (prompt_key)" if key == "prompt" else "")
            )
    if len(dataset) == 0:
        raise UserError(f"{where} has no rows")
    return [
        check_record(row, f"{where} row {i}", require=require, chat=chat, prompt_key=prompt_key, answer_key=answer_key)
        for i, row in enumerate(dataset.to_list())
    ]


def _import_datasets(path: Path):
    try:
        import datasets
    except ImportError:
        raise UserError(f"reading {path} needs the datasets library: pip install datasets") from None
    datasets.disable_progress_bars()
    return datasets


# ----------------------------------------------------------------------------- checks
def check_record(
    record: dict[str, Any],
    where: str,
    *,
    require: Sequence[str] = ("prompt",),
    chat: bool = False,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> dict[str, Any]:
    """``record`` with ``prompt_key`` renamed to ``"prompt"`` and ``answer_key`` to ``"answer"``,
    checked: no reserved field, a column named by a non-default key present, every
    ``require`` key a non-empty string (or chat messages for the prompt with ``chat``).
    ``where`` names the record in errors."""
    record = dict(record)
    keys = ", ".join(record) or "none"  # as the user wrote them
    if RESERVED_FIELD in record:
        raise UserError(
            f'{where}: the field "{RESERVED_FIELD}" is reserved (the reward function gets the '
            'model\'s response under that name); rename the field, e.g. to "reference"'
        )
    for key, target in ((prompt_key, "prompt"), (answer_key, "answer")):
        if key == target:
            continue
        if key not in record:  # a column the user named: every record has it
            raise UserError(f'{where}: missing "{key}" (keys: {keys})')
        if target in record:
            raise UserError(
                f'{where}: has both "{key}" and "{target}"; "{key}" is mapped to "{target}" '
                f"({target}_key={key}), so rename or drop the other"
            )
        record[target] = record.pop(key)
    for key in require:
        source_key = _source_key(key, prompt_key, answer_key)
        if key not in record:
            raise UserError(f'{where}: missing "{source_key}" (keys: {keys})')
        if key == "prompt" and isinstance(record[key], list):
            _check_messages(record[key], chat, where, source_key)
        elif not isinstance(record[key], str) or not record[key]:
            raise UserError(f'{where}: "{source_key}" must be a non-empty string (got {record[key]!r})')
    return record


def _check_messages(value: list, chat: bool, where: str, key: str) -> None:
    if not chat:
        raise UserError(
            f'{where}: "{key}" is a list of chat messages; set data.chat_template=true '
            "(ppokit sft: --chat-template) to render it with the model's chat template, or give the "
            "prompt as a string"
        )
    problem = message_problem(value)
    if problem:
        raise UserError(f'{where}: "{key}": {problem}')


def _source_key(key: str, prompt_key: str, answer_key: str) -> str:
    """The name a record field has in the user's data."""
    return {"prompt": prompt_key, "answer": answer_key}.get(key, key)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def count_tokens_with(tokenizer) -> Any:
    """``count(texts) -> list[int]``: token counts of ``texts`` as ``tokenizer`` encodes them
    for generation (special tokens included, as the rollout does)."""

    def count(texts: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"]]

    return count


def drop_long_prompts(
    records: Sequence[dict[str, Any]], max_tokens: int, *, tokenizer=None, count_tokens: Any | None = None
) -> tuple[list[dict[str, Any]], int]:
    """``(kept records, number dropped)``: the records whose prompt has at most ``max_tokens``
    tokens, in their order. Give a Hugging Face ``tokenizer`` or ``count_tokens(texts) ->
    list[int]``. Prompts must be text (render chat messages first). Dropping every record
    is a :class:`UserError`; reporting the count is the caller's job.
    """
    if (tokenizer is None) == (count_tokens is None):
        raise TypeError("drop_long_prompts: give exactly one of tokenizer= and count_tokens=")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise UserError(f"the prompt token limit must be a positive integer (got {max_tokens!r})")
    if not records:
        return [], 0
    texts = [r["prompt"] for r in records]
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("drop_long_prompts: render chat-message prompts to text first")
    counts = (count_tokens or count_tokens_with(tokenizer))(texts)
    kept = [r for r, c in zip(records, counts) if c <= max_tokens]
    if not kept:
        raise UserError(
            f"all {len(records)} prompts are longer than {max_tokens} tokens (the shortest has "
            f"{min(counts)}); raise the prompt length limit or shorten the prompts"
        )
    return kept, len(records) - len(kept)
