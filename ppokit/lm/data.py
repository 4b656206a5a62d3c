"""Prompt data: a built-in task or a JSONL file, and a resumable prompt iterator.

A prompt record is a dict with a ``"prompt"`` string and any other fields; the other
fields go to the reward function (``answer`` for the built-in tasks). In a JSONL file
each non-blank line is one record::

    {"prompt": "12+30=", "answer": "42"}
    {"prompt": "What is 7*6? ", "answer": "42", "source": "hand-written"}

For supervised warm start the records also need ``"completion"``, the target text.
With ``data.chat_template`` a prompt may also be a list of chat messages,
``[{"role": "user", "content": "..."}]``, rendered by :mod:`ppokit.lm.chat`.

A problem with a file (missing, not UTF-8, a line that is not a JSON object, no
``"prompt"``, no records at all) is a :class:`UserError` naming the file and the line.

:class:`PromptIterator` deals out batches of fresh prompts: it walks a permutation of
the records that is fixed by ``(seed, epoch)``, starts a new permutation when one is used
up, and its position (``state_dict``: plain ints) restores exactly on resume.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from ppokit.errors import UserError

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonlines", ".ndjson")
# The reward function is called as fn(prompt, response, **fields): no field may be named response
# (a "prompt" key is the record's prompt itself and is not passed as a field).
RESERVED_FIELD = "response"
SPLIT_ALIASES = {"train": "train", "rl": "train", "sft": "sft", "eval": "eval", "test": "eval", "heldout": "eval"}


# --------------------------------------------------------------------------- loading
def is_file_source(source: str) -> bool:
    """True when ``source`` names a data file rather than a built-in task."""
    path = Path(source)
    return path.suffix.lower() in JSONL_SUFFIXES or path.is_file() or "/" in source or "\\" in source


def read_jsonl(path: str | Path, *, require: Sequence[str] = ("prompt",),
               chat: bool = False) -> list[dict[str, Any]]:
    """Records of a JSONL file; every field in ``require`` must be a non-empty string, except
    that with ``chat`` a ``"prompt"`` may also be a list of chat messages."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist" if not path.exists()
                        else f"prompt file {path} is not a file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None
    records = []
    for number, line in enumerate(raw.splitlines(), start=1):
        try:
            text = line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"{path} line {number}: not UTF-8 text (byte {exc.start + 1}); "
                            "save the file as UTF-8") from None
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            if path.suffix.lower() not in JSONL_SUFFIXES:
                raise UserError(f"{path}: prompt files are JSONL (one JSON object per line, e.g. data.jsonl); "
                                f"this {path.suffix or 'extension-less'} file is not (line {number}: {exc.msg})") \
                    from None
            raise UserError(f"{path} line {number}: not valid JSON ({exc.msg} at column {exc.colno}); "
                            'each line must be one object like {"prompt": "..."}') from None
        if not isinstance(record, dict):
            raise UserError(f'{path} line {number}: expected a JSON object like {{"prompt": "..."}}, '
                            f"got a {type(record).__name__}")
        if RESERVED_FIELD in record:
            raise UserError(f'{path} line {number}: the field "{RESERVED_FIELD}" is reserved (the reward function '
                            "gets the model's response under that name); rename the field, e.g. to \"reference\"")
        for key in require:
            if key not in record:
                raise UserError(f"{path} line {number}: missing \"{key}\" (keys: {', '.join(record) or 'none'})")
            if key == "prompt" and isinstance(record[key], list):
                _check_messages(record[key], chat, f"{path} line {number}")
            elif not isinstance(record[key], str) or not record[key]:
                raise UserError(f"{path} line {number}: \"{key}\" must be a non-empty string "
                                f"(got {record[key]!r})")
        records.append(record)
    if not records:
        raise UserError(f"{path} is empty: it needs one JSON object per line, each with "
                        + " and ".join(f'"{k}"' for k in require))
    return records


def _check_messages(value: list, chat: bool, where: str) -> None:
    from ppokit.lm.chat import message_problem

    if not chat:
        raise UserError(f'{where}: "prompt" is a list of chat messages; set data.chat_template=true '
                        "(ppokit sft: --chat-template) to render it with the model's chat template, or give the "
                        "prompt as a string")
    problem = message_problem(value)
    if problem:
        raise UserError(f'{where}: "prompt": {problem}')


def load_prompts(source: str, split: str = "train", n: Optional[int] = None, *, chat: bool = False,
                 **task_kwargs: Any) -> list[dict[str, Any]]:
    """Records from a JSONL file or a built-in task's split (``train``, ``sft``, ``eval``).

    A file is one split: ``split`` only decides whether ``"completion"`` is required
    (``sft``). ``n`` keeps the first ``n`` records (a file must have at least ``n``).
    ``chat``: a file's prompts may be lists of chat messages (``data.chat_template``).
    ``task_kwargs`` go to the task (``digits=2``); they are an error with a file.
    """
    if split not in SPLIT_ALIASES:
        raise UserError(f"unknown split {split!r}; use train, sft or eval")
    split = SPLIT_ALIASES[split]
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise UserError(f"the number of prompts must be a positive integer (got {n!r})")
    if not isinstance(source, str) or not source.strip():
        raise UserError("prompt data: give a built-in task name (e.g. arithmetic) or a JSONL file")
    if is_file_source(source):
        if task_kwargs:
            raise UserError(f"options {', '.join(task_kwargs)} apply to built-in tasks, not to the file {source}")
        records = read_jsonl(source, require=("prompt", "completion") if split == "sft" else ("prompt",),
                             chat=chat)
        if n is not None:
            if n > len(records):
                raise UserError(f"{source} has {len(records)} records; asked for {n}")
            records = records[:n]
        return records
    from ppokit.lm.tasks import get_task

    return get_task(source, **task_kwargs).items(split, n)


# -------------------------------------------------------------------------- iterator
class PromptIterator:
    """Batches of prompt records for successive PPO iterations, resumable exactly.

    Epoch ``e`` visits the records in the order ``default_rng([seed, e]).permutation``
    (or in file order with ``shuffle=False``); a batch that runs past the end of an epoch
    continues into the next one, so every batch has ``batch_size`` records.
    """

    def __init__(self, items: Sequence[dict[str, Any]], batch_size: int, *, seed: int = 0,
                 shuffle: bool = True) -> None:
        if not items:
            raise UserError("no prompts to train on")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"prompts per batch must be a positive integer (got {batch_size!r})")
        self.items = list(items)
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order: Optional[np.ndarray] = None
        self._order_epoch = -1

    def __len__(self) -> int:
        """Batches in one epoch (the last one may borrow from the next epoch)."""
        return -(-len(self.items) // self.batch_size)

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.items))
            else:
                self._order = np.arange(len(self.items))
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def next_batch(self) -> list[dict[str, Any]]:
        batch = []
        while len(batch) < self.batch_size:
            order = self._epoch_order()
            take = min(self.batch_size - len(batch), len(order) - self.position)
            batch += [self.items[int(i)] for i in order[self.position:self.position + take]]
            self.position += take
            if self.position == len(order):
                self.epoch += 1
                self.position = 0
        return batch

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        return self

    def __next__(self) -> list[dict[str, Any]]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Plain JSON-able ints: where the next batch starts, and what it walks over."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_items": len(self.items), "batch_size": self.batch_size, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the data must be the data it was saved with."""
        if int(state["num_items"]) != len(self.items):
            raise UserError(f"the prompt data changed since the checkpoint ({state['num_items']} prompts then, "
                            f"{len(self.items)} now); resume with the same data")
        if int(state["seed"]) != self.seed or bool(state.get("shuffle", 1)) != self.shuffle:
            raise UserError("the prompt order changed since the checkpoint (seed or shuffle differ); "
                            "resume with the same seed")
        if not 0 <= int(state["position"]) < len(self.items) or int(state["epoch"]) < 0:
            raise ValueError(f"corrupt prompt iterator state: {state}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
