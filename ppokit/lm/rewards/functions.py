"""Reward functions: plain Python callables ``(prompt, response, **fields) -> float``.

``fields`` are the extra keys of the prompt's record (``answer`` for the built-in tasks,
any key of a JSONL line). A function that does not take ``**kwargs`` receives only the
fields it names, so ``def reward(prompt, response, answer)`` works on data with more
keys. Write one in a file and point at it::

    # my_rewards.py
    def length_penalty(prompt, response, answer):
        return float(response.strip() == answer) - 0.01 * len(response)

    ppokit train ... reward=my_rewards.py:length_penalty     (or reward=pkg.module:fn)

A function may also return ``(score, reason)``: the reason (a short string, or None)
says why a score is low and is counted in the metrics (:func:`split_outcome`).

Built-ins: ``exact_match``, ``numeric_match`` (the final number: ``#### N``, the last
``\boxed{}``, or the last number), ``math`` (math-verify: equivalent expressions),
``code`` (the response's program against the record's tests, in a sandbox), ``countdown``
and ``reasoning_gym`` (the verifiers of those built-in tasks).

:func:`load_reward_fn` checks the spec when it is loaded. :func:`score_responses` runs
a function in this process and turns an exception or a non-finite / non-numeric return
into a :class:`UserError` that names the function and the sample; the training loop
runs rewards through :mod:`ppokit.lm.rewards.pool` instead, where a failing or hanging
sample gets ``reward_on_error`` and is counted.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

from ppokit.errors import UserError, did_you_mean
from ppokit.lm.data import countdown
from ppokit.lm.data import reasoning_gym as reasoning_gym_task
from ppokit.lm.rewards import math_answers, sandbox
from ppokit.user_code import is_user_spec, load_user_object, one_line_error

RewardCallable = Callable[..., float]
INTERNAL_PREFIX = "_ppokit"  # record keys ppokit keeps for itself (ppokit.lm.data.chat.RAW_PROMPT)

# A number: optional sign (only where it cannot be a minus between two operands, as in "3-5"),
# digits with optional thousands commas, optional decimals and exponent; or a bare ".5".
_NUMBER = re.compile(r"(?:(?<![\w)\]}.])[-+])?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
_MARKED = re.compile(r"####")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


# --------------------------------------------------------------------------- built-ins
def exact_match(prompt: str, response: str, *, answer: Any, **_: Any) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals ``answer``."""
    return float(response.strip() == str(answer).strip())


def _to_float(text: str) -> float | None:
    try:
        value = float(text.replace(",", ""))
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def parse_first_number(text: str) -> float | None:
    """The first number in ``text`` (``-12``, ``3.5``, ``1,234``, ``2e3``), or None."""
    match = _NUMBER.search(text)
    return None if match is None else _to_float(match.group())


def parse_last_number(text: str) -> float | None:
    """The last number in ``text``, or None."""
    matches = _NUMBER.findall(text)
    return _to_float(matches[-1]) if matches else None


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``) in ``text``, nested braces
    matched (``\boxed{\frac{1}{2}}`` -> ``\frac{1}{2}``); None if there is none or it is unclosed."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def final_number(text: str) -> float | None:
    r"""The number a chain-of-thought response gives as its final answer, or None.

    The rule, in order:

    1. ``#### N``: the first number after the last ``####`` (GSM8K's answer mark);
    2. else the last ``\boxed{...}`` (nested braces handled), when its content holds exactly
       one number (``\boxed{42}``, ``\boxed{x = -3.5}``); ``\boxed{\frac{1}{2}}`` holds two and
       gives None: the ``math`` reward handles fractions and expressions;
    3. else the last number in the text.

    Numbers may carry a sign, thousands commas (``1,234``), decimals and an exponent; a ``-``
    between two operands (``3-5``) is not a sign.
    """
    marks = list(_MARKED.finditer(text))
    if marks:
        found = _NUMBER.search(text, marks[-1].end())
        if found is not None:
            return _to_float(found.group())
    boxed = last_boxed(text)
    if boxed is not None:
        found_in_box = _NUMBER.findall(boxed)
        return _to_float(found_in_box[0]) if len(found_in_box) == 1 else None
    return parse_last_number(text)


def numeric_match(
    prompt: str, response: str, *, answer: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-6, **_: Any
) -> float:
    r"""1.0 when the response's final number equals ``answer`` numerically, else 0.0.

    The response's number is :func:`final_number`'s: the one after ``####``, else the single
    number in the last ``\boxed{...}``, else the last number in the response (a chain of
    thought ends with its answer). ``answer`` is a number, or a text read by the same rule
    (``"42"``, ``"... #### 42"``). Equal within ``max(abs_tol, rel_tol * |answer|)``; 0.0 when
    the response has no number.
    """
    target = (
        float(answer)
        if isinstance(answer, numbers.Real) and not isinstance(answer, bool)
        else final_number(str(answer))
    )
    if target is None or not math.isfinite(target):
        raise ValueError(f"the answer field {answer!r} is not a number")
    got = final_number(response)
    if got is None:
        return 0.0
    return float(abs(got - target) <= max(abs_tol, rel_tol * abs(target)))


def math_reward(prompt: str, response: str, *, answer: Any, **_: Any) -> float:
    r"""1.0 when math-verify finds the response's answer equal to ``answer`` (``\frac{1}{2}`` =
    ``0.5`` = ``1/2``): :func:`ppokit.lm.rewards.math_answers.math_reward`. Run it in the reward pool,
    which enforces its time limit."""
    return math_answers.math_reward(prompt, response, answer=answer)


def code_reward(prompt: str, response: str, *, tests: Any, **fields: Any) -> tuple[float, str | None]:
    """The fraction of ``tests`` the response's Python program passes in a sandbox, and why
    it failed: :func:`ppokit.lm.rewards.sandbox.code_reward` (the test format is documented there)."""
    return sandbox.code_reward(prompt, response, tests=tests, **fields)


def countdown_reward(prompt: str, response: str, *, numbers: Any, target: Any, **_: Any) -> tuple[float, str | None]:
    """1.0 when the response's expression reaches ``target`` from ``numbers`` (each at most
    once, ``+ - * /``): :func:`ppokit.lm.data.countdown.countdown_reward`."""
    return countdown.countdown_reward(prompt, response, numbers=numbers, target=target)


def reasoning_gym_reward(prompt: str, response: str, *, reasoning_gym: Any, **_: Any) -> tuple[float, str | None]:
    """The reasoning-gym task's own ``score_answer`` (in [0, 1]) of the answer in the response's
    last ``<answer>`` tags: :func:`ppokit.lm.data.reasoning_gym.reasoning_gym_reward`. It runs
    in the reward pool: a task's verifier may be slow (SymPy, puzzle checks)."""
    return reasoning_gym_task.reasoning_gym_reward(prompt, response, reasoning_gym=reasoning_gym)


def _warm_up_math() -> None:
    math_answers.warm_up()


def _warm_up_code() -> None:
    sandbox.warm_up()


# A reward worker calls fn.warm_up() once before its first sample (ppokit.lm.rewards.pool).
math_reward.warm_up = _warm_up_math  # type: ignore[attr-defined]
code_reward.warm_up = _warm_up_code  # type: ignore[attr-defined]
reasoning_gym_reward.warm_up = reasoning_gym_task.warm_up  # type: ignore[attr-defined]

BUILTIN_REWARDS: dict[str, RewardCallable] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "math": math_reward,
    "code": code_reward,
    "countdown": countdown_reward,
    "reasoning_gym": reasoning_gym_reward,
}
# Built-ins that cannot hang on any text (countdown's expressions are size-limited): cheap
# enough to score in the trainer's process.
IN_PROCESS_REWARDS = frozenset({"exact_match", "numeric_match", "countdown"})


# ----------------------------------------------------------------------------- loading
class RewardFunction:
    """A loaded reward function: the callable, its spec, and which fields it accepts."""

    def __init__(self, fn: RewardCallable, spec: str) -> None:
        self.fn = fn
        self.spec = spec
        self.name = spec
        call = getattr(fn, "__call__", None)  # noqa: B004 (an object's async __call__ counts too)
        if any(inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f) for f in (fn, call)):
            raise UserError(
                f"reward function '{spec}' is an async def; rewards are called synchronously, "
                "so make it a plain def that returns a float"
            )
        try:
            signature = inspect.signature(fn)
            params = signature.parameters.values()
        except (TypeError, ValueError):  # some builtins/C callables have no signature
            params = None
        if params is None:
            self._takes_all, self._accepted, self._required = True, set(), set()
            return
        self._takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        has_varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
        if len(positional) < 2 and not has_varargs:
            raise UserError(
                f"reward function '{spec}' must take (prompt, response, **fields), prompt and "
                f"response as its first two positional parameters; it takes {signature}"
            )
        rest = positional[2:] + [p for p in params if p.kind is p.KEYWORD_ONLY]
        self._accepted = {p.name for p in rest}
        self._required = {p.name for p in rest if p.default is p.empty}
        positional_only_extra = [p.name for p in positional[2:] if p.kind is p.POSITIONAL_ONLY]
        if positional_only_extra:
            raise UserError(
                f"reward function '{spec}': field parameters must be passable by name "
                f"({', '.join(positional_only_extra)} are positional-only)"
            )

    def unfilled_fields(self, fields: dict[str, Any]) -> list[str]:
        """The fields this function requires (parameters without a default) that ``fields``
        lacks or holds as None: a prompt record that cannot be scored as it is."""
        return sorted(name for name in self._required if fields.get(name) is None)

    def select_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The fields this function accepts; raises KeyError naming a missing required one."""
        missing = sorted(self._required - set(fields))
        if missing:
            have = ", ".join(sorted(fields)) or "none"
            raise KeyError(f"needs the field(s) {', '.join(missing)} (this sample has: {have})")
        if self._takes_all:
            return dict(fields)
        return {k: v for k, v in fields.items() if k in self._accepted}

    def __call__(self, prompt: str, response: str, **fields: Any) -> Any:
        return self.fn(prompt, response, **self.select_fields(fields))

    def outcome(self, index: int, prompt: str, response: str, fields: dict[str, Any]) -> tuple:
        """``(status, score or reason, note)`` of sample ``index``, failures caught: ``("ok", score,
        note)`` (:func:`split_outcome`), ``("error", reason, None)`` when the function raises,
        ``("bad_value", reason, None)`` when it returns something else than a finite number
        (:func:`as_score`). What :mod:`ppokit.lm.rewards.pool` records."""
        try:
            value = self(prompt, response, **fields)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's function failed
            return "error", one_line_error(exc), None
        try:
            score = as_score(value, self.name, index, prompt)
        except UserError as exc:
            return "bad_value", str(exc), None
        return "ok", score, split_outcome(value)[1]

    def outcomes(self, tasks: Sequence[tuple[int, str, str, dict[str, Any]]]) -> list[tuple]:
        """:meth:`outcome` of each ``(index, prompt, response, fields)`` in ``tasks``, in order."""
        return [self.outcome(*task) for task in tasks]

    def __repr__(self) -> str:
        return f"RewardFunction({self.spec!r})"


def load_reward_fn(spec: str | RewardCallable) -> RewardFunction:
    """A built-in reward by name, ``pkg.module:fn``, or ``path/to/file.py:fn``.

    Any problem (unknown name, module not importable, file missing, attribute missing,
    not callable, wrong signature) raises a one-line :class:`UserError` naming the spec.
    A callable is wrapped as is.
    """
    if isinstance(spec, RewardFunction):
        return spec
    if callable(spec):
        return RewardFunction(spec, getattr(spec, "__qualname__", None) or getattr(spec, "__name__", repr(spec)))
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(
            f"a reward function must be a built-in name ({', '.join(BUILTIN_REWARDS)}), "
            f"module:function or path/to/file.py:function (got {spec!r})"
        )
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return RewardFunction(BUILTIN_REWARDS[spec], spec)
    if not is_user_spec(spec):
        raise UserError(
            f"unknown reward function '{spec}'{did_you_mean(spec, BUILTIN_REWARDS) or ';'} built-ins: "
            f"{', '.join(BUILTIN_REWARDS)}; or give module:function or path/to/file.py:function"
        )
    fn = load_user_object(
        spec, what="reward function", kind="function", fix="point at a def taking (prompt, response, **fields)"
    )
    return RewardFunction(fn, spec)


# ----------------------------------------------------------------------------- scoring
def reward_fields(record: dict[str, Any]) -> dict[str, Any]:
    """A prompt record's data fields, as the reward function gets them: all but ``prompt``
    and ppokit's own keys (:data:`INTERNAL_PREFIX`)."""
    return {k: v for k, v in record.items() if k != "prompt" and not k.startswith(INTERNAL_PREFIX)}


def score_responses(
    fn: str | RewardCallable,
    prompts: Sequence[str],
    responses: Sequence[str],
    fields_list: Sequence[dict[str, Any]] | None = None,
) -> list[float]:
    """Call the reward function on each sample; a list of floats.

    A raised exception, or a return that is not a finite number, becomes a UserError
    naming the function, the sample index, the prompt, and the error.
    """
    reward = load_reward_fn(fn)
    if fields_list is None:
        fields_list = [{}] * len(prompts)
    if not len(prompts) == len(responses) == len(fields_list):
        raise ValueError(
            f"score_responses: {len(prompts)} prompts, {len(responses)} responses and "
            f"{len(fields_list)} field dicts must have the same length"
        )
    scores = []
    for i, (prompt, response, fields) in enumerate(zip(prompts, responses, fields_list)):
        fields = reward_fields(fields)
        try:
            value = reward(prompt, response, **fields)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's function failed
            raise UserError(
                f"reward function '{reward.name}' failed on sample {i} (prompt {_short(prompt)}): {one_line_error(exc)}"
            ) from None
        scores.append(as_score(value, reward.name, i, prompt))
    return scores


def split_outcome(value: Any) -> tuple[Any, str | None]:
    """A reward function's return as ``(score, note)``: a function may return a number, or
    ``(number, reason)`` where ``reason`` (a string, or None) says why the score is low
    (the ``code`` reward's "timeout", say); notes are counted, not errors."""
    if isinstance(value, tuple) and len(value) == 2 and (value[1] is None or isinstance(value[1], str)):
        return value[0], value[1]
    return value, None


def as_score(value: Any, name: str, index: int, prompt: str) -> float:
    value, _ = split_outcome(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy / torch scalar
        item = value.item()
        if not isinstance(item, numbers.Real):
            raise UserError(
                f"reward function '{name}' returned {value!r} on sample {index} "
                f"(prompt {_short(prompt)}); it must return a number"
            )
        value = item
    if isinstance(value, numbers.Real):
        try:
            score = float(value)
        except OverflowError:
            raise UserError(
                f"reward function '{name}' returned a number too large for a float on sample {index} "
                f"(prompt {_short(prompt)}); rewards must be finite floats"
            ) from None
    else:
        raise UserError(
            f"reward function '{name}' returned {type(value).__name__} {_short(repr(value))} on sample "
            f"{index} (prompt {_short(prompt)}); it must return a float"
        )
    if not math.isfinite(score):
        raise UserError(
            f"reward function '{name}' returned {score} on sample {index} (prompt {_short(prompt)}); "
            "rewards must be finite"
        )
    return score


def _short(text: str, limit: int = 40) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 4] + "...'"
