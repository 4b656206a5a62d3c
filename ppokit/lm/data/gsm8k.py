"""GSM8K-format data from a file the user supplies: ``gsm8k:path=train.jsonl``.

Each record has a ``question`` and an ``answer`` whose last line is ``#### N`` (GSM8K's
format; the lines before it are the worked solution)::

    {"question": "Natalia sold clips to 48 of her friends ...",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\n... \\n#### 72"}

The prompt is the question; the gold answer (the ``answer`` field the verifier gets) is
the number after ``####``, commas removed; the worked solution, with GSM8K's calculator
annotations ``<<48/2=24>>`` removed and ``#### N`` kept, is the SFT completion and the
``solution`` field. The file may be JSONL, Parquet or a ``datasets`` directory
(:mod:`ppokit.lm.data.records`). The default verifier is ``math`` (``numeric_match`` also fits).

Held-out problems: ``eval_path=test.jsonl`` gives them; without it a fixed
``eval_fraction`` of the file (chosen by a hash of the question, whatever the seed) is
held out and the rest is for training.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

from ppokit.errors import UserError
from ppokit.lm.data.records import read_records

SPLITS = ("eval", "sft", "train")
_CALCULATOR = re.compile(r"<<[^<>]*>>")
_NUMBER = re.compile(r"^[-+]?(?:\d[\d,]*)(?:\.\d+)?$")
_BUCKETS = 1000


def gsm8k_final_answer(text: str) -> str | None:
    """The number after the last ``####`` of a GSM8K answer (commas removed), or None."""
    marks = text.rsplit("####", 1)
    if len(marks) != 2:
        return None
    value = marks[1].strip().replace(",", "").rstrip(".")
    return value if _NUMBER.match(value) else None


class GSM8KTask:
    """Records of a GSM8K-format file (module docstring)."""

    name = "gsm8k"
    default_reward = "math"

    def __init__(self, path: str = "", eval_path: str | None = None, eval_fraction: float = 0.1) -> None:
        if not isinstance(path, str) or not path:
            raise UserError(
                "task gsm8k needs the data file: gsm8k:path=train.jsonl (JSONL, Parquet or a datasets "
                "directory with question and answer fields)"
            )
        if not isinstance(eval_fraction, (int, float)) or not 0 <= eval_fraction < 1:
            raise UserError(f"task gsm8k: eval_fraction must be in [0, 1) (got {eval_fraction!r})")
        self.path, self.eval_path, self.eval_fraction = path, eval_path, float(eval_fraction)

    def __repr__(self) -> str:
        return f"GSM8KTask(path={self.path!r})"

    def _read(self, path: str, split: str) -> list[dict[str, Any]]:
        records = read_records(
            path, split="eval" if split == "eval" else "train", prompt_key="question", require=("prompt", "answer")
        )
        out = []
        for i, record in enumerate(records, start=1):
            final = gsm8k_final_answer(record["answer"])
            if final is None:
                raise UserError(
                    f"{path} record {i}: the answer must end with '#### N', a number "
                    f"(got ...{record['answer'][-40:]!r})"
                )
            solution = _CALCULATOR.sub("", record.pop("answer")).strip()
            out.append({**record, "answer": final, "solution": solution})
        return out

    def _held_out(self, record: dict[str, Any]) -> bool:
        return zlib.crc32(record["prompt"].encode()) % _BUCKETS < round(self.eval_fraction * _BUCKETS)

    def items(self, split: str, n: int | None = None) -> list[dict[str, Any]]:
        """``{"prompt", "answer", "solution", ...}`` records of a split (``sft`` adds
        ``"completion"``, the solution); the first ``n`` of them, in file order."""
        if split not in SPLITS:
            raise UserError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
        if split == "eval" and self.eval_path is not None:
            records = self._read(self.eval_path, "eval")
        else:
            records = self._read(self.path, split)
            if self.eval_path is None:
                records = [r for r in records if self._held_out(r) == (split == "eval")]
        if not records:
            raise UserError(
                f"{self!r}: the {split} split is empty (eval_fraction={self.eval_fraction:g}); "
                "give eval_path or change eval_fraction"
            )
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise UserError(
                    f"task gsm8k: the number of {split} problems must be a non-negative integer (got {n!r})"
                )
            if n > len(records):
                raise UserError(f"{self!r} has {len(records)} {split} problems; asked for {n}")
            records = records[:n]
        if split == "sft":
            records = [{**r, "completion": r["solution"]} for r in records]
        return records
