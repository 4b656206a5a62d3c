"""Built-in procedural tasks with verifiable answers, and their registry.

A task hands out three disjoint splits of its problems through ``items(split, n)``:

- ``"sft"``: ``{"prompt", "completion", "answer"}`` for the supervised warm start (the
  model is trained on ``prompt + completion + <eos>``);
- ``"train"``: ``{"prompt", "answer"}`` for PPO; only the prompt is shown to the policy,
  ``answer`` is a field for the reward function;
- ``"eval"``: ``{"prompt", "answer"}``, held out from both SFT and RL.

:class:`ArithmeticTask` enumerates the problems ``a <op> b`` (``a``, ``b`` with exactly
``digits`` digits; 0-9 for one digit) by an index ``i = (a - lo) * K + (b - lo)``. A
problem's split is a fixed hash of its index (10% held out, 30% SFT, 60% RL by default),
independent of the seed, so the splits are disjoint by construction and the held-out set
of one seed never leaks into the training set of another. The seed only orders each
split; ``split(n)`` is a prefix of ``split(m)`` for ``n < m``.

Registered tasks (:data:`TASKS`): ``arithmetic``, ``countdown``
(:mod:`ppokit.lm.data.countdown`, verified by the ``countdown`` reward), ``gsm8k``
(:mod:`ppokit.lm.data.gsm8k`: a GSM8K-format file the user gives, verified by ``math``)
and ``reasoning_gym`` (:mod:`ppokit.lm.data.reasoning_gym`: a family of tasks, named
``reasoning_gym:<task>[:options]``, verified by the task's own ``score_answer``).
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ppokit.errors import UserError, did_you_mean
from ppokit.lm.data.countdown import CountdownTask
from ppokit.lm.data.gsm8k import GSM8KTask
from ppokit.lm.data.reasoning_gym import ReasoningGymTask
from ppokit.lm.data.splits import ASKED_BY

SPLITS = ("eval", "sft", "train")
_ENUMERATE_MAX = 1 << 21  # problem spaces up to this size are enumerated exactly
_BUCKETS = 1000


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a fixed, well-spread hash of uint64 values."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


class ArithmeticTask:
    """``"37+48="`` -> ``"85"``: two operands with ``digits`` digits and an operator.

    ``op`` is ``+``, ``-`` (answers may be negative) or ``*``. ``eval_fraction`` and
    ``sft_fraction`` size the held-out and SFT splits; RL gets the rest.
    """

    name = "arithmetic"
    default_reward = "exact_match"
    OPS: dict[str, Callable[[int, int], int]] = {
        "+": lambda a, b: a + b,
        "-": lambda a, b: a - b,
        "*": lambda a, b: a * b,
    }

    def __init__(
        self, digits: int = 2, op: str = "+", seed: int = 0, eval_fraction: float = 0.1, sft_fraction: float = 0.3
    ) -> None:
        if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 9:
            raise UserError(f"task arithmetic: digits must be an integer from 1 to 9 (got {digits!r})")
        if op not in self.OPS:
            raise UserError(f"task arithmetic: op must be one of {', '.join(self.OPS)} (got {op!r})")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise UserError(f"task arithmetic: seed must be a non-negative integer (got {seed!r})")
        for label, value in (("eval_fraction", eval_fraction), ("sft_fraction", sft_fraction)):
            if not isinstance(value, (int, float)) or not 1 / _BUCKETS <= value < 1:
                raise UserError(f"task arithmetic: {label} must be between {1 / _BUCKETS} and 1 (got {value!r})")
        if eval_fraction + sft_fraction >= 1:
            raise UserError(
                f"task arithmetic: eval_fraction + sft_fraction = {eval_fraction + sft_fraction:g} "
                "must be < 1 to leave problems for RL"
            )
        self.digits, self.op, self.seed = digits, op, seed
        self.lo = 0 if digits == 1 else 10 ** (digits - 1)
        self.k = 10**digits - self.lo  # operands per side
        self.num_problems = self.k * self.k
        # bucket < eval_cut: eval; < sft_cut: sft; else train
        self._cuts = (round(eval_fraction * _BUCKETS), round((eval_fraction + sft_fraction) * _BUCKETS))
        if not 0 < self._cuts[0] < self._cuts[1] < _BUCKETS:  # every split non-empty (sampling terminates)
            raise UserError(
                f"task arithmetic: eval_fraction={eval_fraction} and sft_fraction={sft_fraction} "
                f"leave a split empty; use multiples of {1 / _BUCKETS}"
            )
        self._salt = np.uint64(zlib.crc32(f"arithmetic{op}{digits}".encode()))
        self._order: dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        return f"ArithmeticTask(digits={self.digits}, op={self.op!r}, seed={self.seed})"

    # ---------------------------------------------------------------- problems
    def problem(self, index: int) -> dict[str, Any]:
        a, b = self.lo + index // self.k, self.lo + index % self.k
        return {"prompt": f"{a}{self.op}{b}=", "answer": str(self.OPS[self.op](a, b))}

    @property
    def max_answer_length(self) -> int:
        """Characters in the longest answer (to size ``max_new_tokens``)."""
        lo, hi = self.lo, 10**self.digits - 1
        return max(len(str(self.OPS[self.op](a, b))) for a in (lo, hi) for b in (lo, hi))

    def split_of(self, indices: np.ndarray) -> np.ndarray:
        """0 (eval), 1 (sft) or 2 (train) for each problem index."""
        bucket = _mix64(np.asarray(indices, dtype=np.uint64) + self._salt) % np.uint64(_BUCKETS)
        return (bucket >= self._cuts[0]).astype(np.int64) + (bucket >= self._cuts[1]).astype(np.int64)

    def split_size(self, split: str) -> int | None:
        """Problems in ``split`` (None when the space is too large to enumerate)."""
        if self.num_problems > _ENUMERATE_MAX:
            return None
        return len(self._enumerated(split))

    def indices(self, split: str, n: int | None = None) -> np.ndarray:
        """The first ``n`` problem indices of ``split`` in this seed's order."""
        if split not in SPLITS:
            raise UserError(f"unknown split {split!r}{did_you_mean(str(split), SPLITS)} splits: {', '.join(SPLITS)}")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise UserError(
                f"task arithmetic: the number of {split} problems must be a non-negative integer (got {n!r})"
            )
        if self.num_problems <= _ENUMERATE_MAX:
            order = self._enumerated(split)
            if n is not None and n > len(order):
                raise UserError(
                    f"{self!r} has {len(order)} {split} problems; asked for {n} ({ASKED_BY[split]}): "
                    "use more digits or ask for fewer"
                )
            return order if n is None else order[:n]
        if n is None:
            raise UserError(f"{self!r} has too many problems to list them all; ask for a number of them")
        return self._sampled(split, n)

    def _enumerated(self, split: str) -> np.ndarray:
        if split not in self._order:
            everything = np.arange(self.num_problems, dtype=np.int64)
            members = everything[self.split_of(everything) == SPLITS.index(split)]
            rng = np.random.default_rng([self.seed, SPLITS.index(split)])
            self._order[split] = members[rng.permutation(len(members))]
        return self._order[split]

    def _sampled(self, split: str, n: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, SPLITS.index(split)])
        out: list[int] = []
        seen: set[int] = set()
        while len(out) < n:
            draw = rng.integers(0, self.num_problems, size=4096, dtype=np.int64)
            for i in draw[self.split_of(draw) == SPLITS.index(split)].tolist():
                if i not in seen:
                    seen.add(i)
                    out.append(i)
        return np.asarray(out[:n], dtype=np.int64)

    def items(self, split: str, n: int | None = None) -> list[dict[str, Any]]:
        """The first ``n`` items of a split by name (``sft``, ``train``, ``eval``)."""
        items = [self.problem(int(i)) for i in self.indices(split, n)]
        if split == "sft":
            items = [{"prompt": it["prompt"], "completion": it["answer"], "answer": it["answer"]} for it in items]
        return items


# ------------------------------------------------------------------------- registry
TASKS: dict[str, type] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "gsm8k": GSM8KTask,
    "reasoning_gym": ReasoningGymTask,
}


def task_names() -> list[str]:
    return sorted(TASKS)


def get_task(spec: str, **kwargs: Any):
    """A built-in task by name: ``get_task("arithmetic", digits=2)``.

    ``spec`` may carry options after a colon, as on a command line:
    ``"arithmetic:digits=3,op=*"``, ``"countdown:num_count=3"``,
    ``"gsm8k:path=train.jsonl,eval_path=test.jsonl"`` (keyword arguments win over them).
    A family of tasks (a class with ``from_spec``) names its member after the first colon,
    then its options: ``"reasoning_gym:chain_sum:size=500"``; it gets the options as
    written and converts them itself.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"a task name must be a non-empty string; built-in tasks: {', '.join(task_names())}")
    name, _, options = spec.strip().partition(":")
    if name == "textarena":  # a game, not a prompt set: it is played as a text environment
        raise UserError(
            f"{spec.strip()} is a TextArena game, not a prompt set: play it as a text environment with "
            f"textenv.env={spec.strip()} (as the smollm2_tictactoe preset does), not data.prompts"
        )
    if name not in TASKS:
        raise UserError(
            f"unknown task '{name}'{did_you_mean(name, TASKS)} "
            f"built-in tasks: {', '.join(task_names())}; or give a JSONL or Parquet file of prompts"
        )
    cls = TASKS[name]
    from_spec = getattr(cls, "from_spec", None)
    if from_spec is not None:  # a family: name:<member>[:key=value,...]
        member, _, options = options.partition(":")
        return from_spec(member.strip(), _parse_options(spec, options, str) if options else {}, **kwargs)
    parsed = _parse_options(spec, options) if options else {}
    parsed.update(kwargs)
    allowed = [p for p in inspect.signature(cls).parameters if p != "self"]
    for key in parsed:
        if key not in allowed:
            raise UserError(
                f"task '{name}' has no option '{key}'{did_you_mean(key, allowed) or ';'} options: {', '.join(allowed)}"
            )
    return cls(**parsed)


def _parse_options(spec: str, options: str, convert: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """``key=value,key=value`` as a dict, each value converted by ``convert`` (default:
    an int, else a float, else the text)."""
    out: dict[str, Any] = {}
    for part in options.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise UserError(f"task '{spec}': options must look like name:key=value,key=value")
        out[key] = (convert or _parse_value)(value)
    return out


def _parse_value(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text
