"""Prompt data: a built-in task or the user's file, and a resumable prompt iterator.

A prompt record is a dict with a ``"prompt"`` string and any other fields; the other
fields go to the reward function (``answer`` for the built-in tasks). A source is

- a built-in task by name, with options: ``arithmetic``, ``countdown:num_count=4``,
  ``gsm8k:path=train.jsonl`` (:mod:`ppokit.lm.data.tasks`);
- a JSONL file, each non-blank line one record::

      {"prompt": "12+30=", "answer": "42"}
      {"prompt": "What is 7*6? ", "answer": "42", "source": "hand-written"}

- a Parquet file, or a directory written by ``datasets``' ``save_to_disk``
  (:mod:`ppokit.lm.data.records`; its columns are the fields).

``prompt_key`` and ``answer_key`` name the columns that hold the prompt and the answer
(``question``/``solution``, say): they become the ``"prompt"`` and the ``"answer"`` field.
For supervised warm start the records also need ``"completion"``, the target text.
With ``data.chat_template`` a prompt may also be a list of chat messages,
``[{"role": "user", "content": "..."}]``, rendered by :mod:`ppokit.lm.data.chat`.
:func:`drop_long_prompts` filters prompts over a token limit.

A problem with a file (missing, not UTF-8, a line that is not a JSON object, no
``"prompt"``, no records at all) is a :class:`UserError` naming the file and the line
(the row, for Parquet and dataset directories).

:class:`PromptIterator` deals out batches of fresh prompts, epoch after epoch: it walks a
permutation of the records that is fixed by ``(seed, epoch)``, starts a new permutation
when one is used up, and its position (``state_dict``: plain ints) restores exactly on
resume, at an epoch boundary included.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ppokit.errors import UserError
from ppokit.lm.data.records import (  # noqa: F401
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    RESERVED_FIELD,
    count_tokens_with,
    drop_long_prompts,
    read_jsonl,
    read_records,
)
from ppokit.lm.data.tasks import TASKS, get_task

SPLIT_ALIASES = {"train": "train", "rl": "train", "sft": "sft", "eval": "eval", "test": "eval", "heldout": "eval"}


# --------------------------------------------------------------------------- loading
def is_file_source(source: str) -> bool:
    """True when ``source`` names a data file or directory rather than a built-in task.

    ``task:options`` with a built-in task's name is a task even when an option is a path
    (``gsm8k:path=data/train.jsonl``).
    """
    name, sep, _ = source.strip().partition(":")
    path = Path(source)
    if name in TASKS and (sep or not path.exists()):
        return False
    suffix = path.suffix.lower()
    return suffix in JSONL_SUFFIXES or suffix in PARQUET_SUFFIXES or path.exists() or "/" in source or "\\" in source


def load_prompts(
    source: str,
    split: str = "train",
    n: int | None = None,
    *,
    chat: bool = False,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    **task_kwargs: Any,
) -> list[dict[str, Any]]:
    """Records from a file (JSONL, Parquet, ``save_to_disk`` directory) or a built-in task's
    split (``train``, ``sft``, ``eval``).

    A file is one split: ``split`` only decides whether ``"completion"`` is required
    (``sft``); a ``DatasetDict`` directory's split is picked by name (``train``; ``test``,
    ``validation``... for ``eval``). ``n`` keeps the first ``n`` records (a file must have
    at least ``n``). ``chat``: a file's prompts may be lists of chat messages
    (``data.chat_template``). ``prompt_key`` / ``answer_key``: the file's columns that
    become ``"prompt"`` and ``"answer"``. ``task_kwargs`` go to the task (``digits=2``);
    they are an error with a file.
    """
    if split not in SPLIT_ALIASES:
        raise UserError(f"unknown split {split!r}; use train, sft or eval")
    split = SPLIT_ALIASES[split]
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise UserError(f"the number of prompts must be a positive integer (got {n!r})")
    if not isinstance(source, str) or not source.strip():
        raise UserError(
            "prompt data: give a built-in task name (e.g. arithmetic), a JSONL or Parquet file, or a datasets directory"
        )
    for label, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        if not isinstance(key, str) or not key:
            raise UserError(f"{label} must be a non-empty column name (got {key!r})")
    if is_file_source(source):
        if task_kwargs:
            raise UserError(f"options {', '.join(task_kwargs)} apply to built-in tasks, not to the file {source}")
        records = read_records(
            source,
            split=split,
            require=("prompt", "completion") if split == "sft" else ("prompt",),
            chat=chat,
            prompt_key=prompt_key,
            answer_key=answer_key,
        )
        if n is not None:
            if n > len(records):
                raise UserError(f"{source} has {len(records)} records; asked for {n}")
            records = records[:n]
        return records

    return get_task(source, **task_kwargs).items(split, n)


# -------------------------------------------------------------------------- iterator
class PromptIterator:
    """Batches of prompt records for successive PPO iterations, resumable exactly.

    Epoch ``e`` visits the records in the order ``default_rng([seed, e]).permutation``
    (or in file order with ``shuffle=False``); the epochs follow one another without end
    (the run's iteration count decides how many batches are drawn). A batch that runs
    past the end of an epoch continues into the next one, so every batch has
    ``batch_size`` records (and may then hold a record twice when the data is small).

    The state is ``(epoch, position)``: the next batch starts at ``position`` of epoch
    ``epoch``'s order. A batch that ends exactly at an epoch's end leaves
    ``(epoch + 1, 0)``, so a run resumed from a checkpoint taken there starts the next
    epoch with its first batch (a state written as ``position == len(items)`` is read
    the same way): never an empty epoch.
    """

    def __init__(
        self, items: Sequence[dict[str, Any]], batch_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
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
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def __len__(self) -> int:
        """Batches in one epoch (the last one may borrow from the next epoch)."""
        return -(-len(self.items) // self.batch_size)

    @property
    def batches_drawn(self) -> int:
        """Batches handed out since the start (epoch 0, position 0): the run's step count."""
        return -(-(self.epoch * len(self.items) + self.position) // self.batch_size)

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
            batch += [self.items[int(i)] for i in order[self.position : self.position + take]]
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
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_items": len(self.items),
            "batch_size": self.batch_size,
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the data must be the data it was saved with."""
        if int(state["num_items"]) != len(self.items):
            raise UserError(
                f"the prompt data changed since the checkpoint ({state['num_items']} prompts then, "
                f"{len(self.items)} now); resume with the same data"
            )
        if int(state["seed"]) != self.seed or bool(state.get("shuffle", 1)) != self.shuffle:
            raise UserError(
                "the prompt order changed since the checkpoint (seed or shuffle differ); resume with the same seed"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if not 0 <= position <= len(self.items) or epoch < 0:
            raise ValueError(f"corrupt prompt iterator state: {state}")
        if position == len(self.items):  # saved as "end of epoch": the next one's start
            epoch, position = epoch + 1, 0
        self.epoch, self.position = epoch, position
