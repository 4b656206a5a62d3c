"""Procedural reasoning tasks of the optional package reasoning-gym: ``reasoning_gym:<task>``.

``data.prompts: reasoning_gym:<task>[:options]`` makes one of reasoning-gym's ~100 generated tasks
a built-in task of ppokit (:mod:`ppokit.lm.data.tasks`). :class:`ReasoningGymTask` builds it from
the spec (:func:`convert_option` types the text options) and deals its problems to the splits;
:func:`reasoning_gym_reward` (the reward ``reasoning_gym``) scores a response with the task's own
``score_answer`` on its last ``<answer>...</answer>``, a score in [0, 1].

Seeds: ppokit seed ``s`` walks, by index, reasoning-gym's dataset created with the seed
``s * 2**20`` (:data:`SEED_STRIDE`). reasoning-gym derives problem ``i`` from its seed plus ``i``, so
two ppokit seeds never share a generator seed, and ``s <= 4095`` keeps every generator seed below
2**32. Each problem goes to a split by a fixed hash of its question text, as ``countdown`` does:
the train, SFT and held-out problems are disjoint whatever the seed and the sizes, and
``items(split, n)`` is a prefix of ``items(split, m)`` for n < m. A record carries what the
verifier needs as plain picklable data (reward workers get it over a socket). reasoning-gym is
imported only when a task or the reward is used (``pip install 'ppokit[reasoning]'``). Options,
the prompt, generation times and the warm start: docs/environments.md, "reasoning-gym tasks".
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import io
import math
import types
import typing
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ppokit.errors import UserError, did_you_mean
from ppokit.lm.data.splits import ASKED_BY, hashed_split, split_cuts
from ppokit.user_code import one_line_error

NAME = "reasoning_gym"
SPLITS = ("eval", "sft", "train")
INSTALL = "reasoning_gym tasks need the optional package: pip install 'ppokit[reasoning]'"
INSTRUCTION = "Give your final answer in <answer> </answer> tags.\n"
NO_ANSWER = "no answer tags"
SEED_STRIDE = 2**20  # reasoning-gym seeds per ppokit seed (module docstring)
MAX_SEED = 2**32 // SEED_STRIDE - 1  # 4095: every generator seed stays below 2**32
MIN_WINDOW = 50_000
_STREAMS_KEPT = 4  # problem streams cached per process (a run reads train, eval and sft)
_SCORERS_KEPT = 16  # datasets cached per reward worker, for their score_answer
_OWN_OPTIONS = ("size", "eval_size", "seed", "eval_fraction", "sft_fraction")
_TRUE, _FALSE, _NONE = ("true", "yes", "on", "1"), ("false", "no", "off", "0"), ("none", "null")


def _import():
    """The reasoning-gym package (its factory, its answer extraction), or a one-line UserError."""
    try:
        import reasoning_gym  # noqa: PLC0415 - optional, and a second to import: only when used
        import reasoning_gym.factory  # noqa: PLC0415
        import reasoning_gym.utils  # noqa: PLC0415
    except ImportError:
        raise UserError(INSTALL) from None
    return reasoning_gym


def task_names() -> list[str]:
    """The registered reasoning-gym tasks (needs the package)."""
    return sorted(_import().factory.DATASETS)


@contextlib.contextmanager
def _quiet():
    """Swallow a generator's prints to stdout (they would break ``--json`` outputs)."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


# ----------------------------------------------------------------------------- options
def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is None and isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def convert_option(text: str, annotation: Any, where: str) -> Any:
    """``text`` (an option's value as written) as a value of the type ``annotation`` of a
    reasoning-gym configuration field; a one-line UserError when it is not one (``where``
    names the option)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    text = text.strip()
    if origin in (typing.Union, types.UnionType):
        if text.lower() in _NONE and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            return convert_option(text, members[0], where)
        raise UserError(f"{where}: a value of type {_type_name(annotation)} cannot be given as text; use Python")
    if origin is typing.Literal:
        for choice in args:
            if str(choice) == text:
                return choice
        raise UserError(f"{where} must be one of {', '.join(map(str, args))} (got {text!r})")
    if annotation is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise UserError(f"{where} must be true or false (got {text!r})")
    if annotation is int:
        try:
            return int(text)
        except ValueError:
            raise UserError(f"{where} must be an integer (got {text!r})") from None
    if annotation is float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise UserError(f"{where} must be a finite number (got {text!r})")
        return value
    if annotation is str:
        return text
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        for member in annotation:
            if text in (str(member.value), member.name):
                return member
        choices = ", ".join(str(m.value) for m in annotation)
        raise UserError(f"{where} must be one of {choices} (got {text!r})")
    if annotation in (datetime.date, datetime.time):
        try:
            return annotation.fromisoformat(text)
        except ValueError:
            raise UserError(f"{where} must be a {annotation.__name__} in ISO format (got {text!r})") from None
    sequence = annotation in (list, tuple) or origin in (list, tuple, Sequence, typing.Sequence)
    if sequence:
        # list[X], tuple[X, ...], tuple[X] (a tuple of any length in reasoning-gym's configs), Sequence[X]
        element = args[0] if args else str
        nested = typing.get_origin(element) is not None or element in (list, tuple)
        if nested or not all(a in (element, Ellipsis) for a in args):
            raise UserError(f"{where}: a value of type {_type_name(annotation)} cannot be given as text; use Python")
        values = [convert_option(part, element, where) for part in text.split("|")] if text else []
        return tuple(values) if (annotation is tuple or origin is tuple) else values
    raise UserError(f"{where}: a value of type {_type_name(annotation)} cannot be given as text; use Python")


def _check_int(where: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserError(f"{where} must be an integer from {low} to {high} (got {value!r})")
    return value


# -------------------------------------------------------------------------------- task
class ReasoningGymTask:
    """One reasoning-gym task as a ppokit task (module docstring): ``items(split, n)`` gives
    ``{"prompt", "answer", "reasoning_gym"}`` records, disjoint across the splits ``train``,
    ``sft`` (with ``"completion"``) and ``eval``.

    ``task``: the reasoning-gym task name; ``size``: training problems (``items("train")``);
    ``eval_size``: held-out problems when no number is asked for; ``seed``: 0 to 4095;
    ``options``: the task's own configuration (typed values). Build it from a spec with
    :meth:`from_spec` (which converts text options). Every mistake in the options is a
    one-line :class:`UserError`, raised here, before any model loads.
    """

    name = NAME
    default_reward = NAME

    def __init__(
        self,
        task: str = "",
        size: int = 2000,
        eval_size: int = 100,
        seed: int = 0,
        eval_fraction: float = 0.1,
        sft_fraction: float = 0.3,
        **options: Any,
    ) -> None:
        rg = _import()
        names = sorted(rg.factory.DATASETS)
        if not isinstance(task, str) or not task:
            raise UserError(
                f"reasoning_gym needs a task name: reasoning_gym:<task>, e.g. reasoning_gym:chain_sum "
                f"(tasks: {', '.join(names)})"
            )
        if task not in rg.factory.DATASETS:
            raise UserError(
                f"reasoning_gym:{task} is not a reasoning-gym task{did_you_mean(task, names)} "
                f"(tasks: {', '.join(names)})"
            )
        self.task = task
        where = f"reasoning_gym:{task}"
        self.size = _check_int(f"{where}: size", size, 1, SEED_STRIDE // 2)
        self.eval_size = _check_int(f"{where}: eval_size", eval_size, 1, SEED_STRIDE // 2)
        self.seed = _check_int(f"{where}: seed", seed, 0, MAX_SEED)
        self._cuts = split_cuts(where, eval_fraction, sft_fraction)
        _, config_cls = rg.factory.DATASETS[task]
        fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
        allowed = [*_OWN_OPTIONS, *fields]
        for key in options:
            if key not in allowed:
                raise UserError(
                    f"{where} has no option '{key}'{did_you_mean(key, allowed) or ';'} options: {', '.join(allowed)}"
                )
        self.options = dict(options)
        self.base_seed = self.seed * SEED_STRIDE
        self.window = min(SEED_STRIDE, max(MIN_WINDOW, 20 * (self.size + self.eval_size)))
        try:  # the configuration's own checks, now: a bad value fails before any model loads
            with _quiet():
                config = config_cls(seed=self.base_seed, size=self.window, **self.options)
                if callable(getattr(config, "validate", None)):
                    config.validate()
        except Exception as exc:  # noqa: BLE001 - reasoning-gym checks with assert, ValueError, TypeError...
            given = ", ".join(f"{k}={v!r}" for k, v in self.options.items()) or "defaults"
            raise UserError(f"{where}: invalid options ({given}): {one_line_error(exc)}") from None

    @classmethod
    def from_spec(cls, member: str, text_options: dict[str, str], **kwargs: Any) -> ReasoningGymTask:
        """The task of ``reasoning_gym:<member>:key=value,...``: ``text_options`` are the values
        as written, converted here to the types the options have (keyword arguments are
        typed already and win over them; ``task=`` may name the member instead)."""
        rg = _import()
        task = kwargs.pop("task", member)  # get_task("reasoning_gym", task="chain_sum")
        options: dict[str, Any] = {}
        hints: dict[str, Any] = {}
        if task in rg.factory.DATASETS:
            try:
                hints = typing.get_type_hints(rg.factory.DATASETS[task][1])
            except Exception:  # noqa: BLE001 - an annotation that does not resolve: values stay text
                hints = {}
        where = f"reasoning_gym:{task}"
        own = {"size": int, "eval_size": int, "seed": int, "eval_fraction": float, "sft_fraction": float}
        for key, text in text_options.items():
            if key in own:
                options[key] = convert_option(text, own[key], f"{where}: {key}")
            elif key in hints:
                options[key] = convert_option(text, hints[key], f"{where}: {key}")
            else:
                options[key] = text  # unknown: __init__ names it
        options.update(kwargs)
        return cls(task, **options)

    def __repr__(self) -> str:
        return f"ReasoningGymTask({self.task!r}, seed={self.seed})"

    # ---------------------------------------------------------------------- problems
    def split_of(self, question: str) -> str:
        """The split a problem belongs to: a fixed hash of its question text."""
        return hashed_split(question.encode("utf-8", "surrogatepass"), self._cuts)

    def _stream(self) -> _Stream:
        key = (self.task, self.base_seed, self.window, self._cuts, repr(sorted(self.options.items())))
        stream = _STREAMS.pop(key, None) or _Stream(self)
        _STREAMS[key] = stream  # most recent last
        while len(_STREAMS) > _STREAMS_KEPT:
            _STREAMS.popitem(last=False)
        return stream

    def record(self, index: int, entry: dict[str, Any]) -> dict[str, Any]:
        """A prompt record of reasoning-gym's item ``entry`` (problem ``index`` of the walk)."""
        return {
            "prompt": f"{entry['question']}\n{INSTRUCTION}",
            "answer": entry.get("answer"),
            NAME: {
                "task": self.task,
                "seed": self.base_seed,
                "index": index,
                "options": dict(self.options),
                "entry": entry,
            },
        }

    def items(self, split: str, n: int | None = None) -> list[dict[str, Any]]:
        """The first ``n`` problems of a split (``train``: ``size`` when ``n`` is None,
        ``eval``: ``eval_size``, ``sft``: ``size``). SFT records add ``"completion"``: the
        reference answer in answer tags."""
        if split not in SPLITS:
            raise UserError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
        if n is None:
            n = self.eval_size if split == "eval" else self.size
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise UserError(
                f"reasoning_gym:{self.task}: the number of {split} problems must be a non-negative integer (got {n!r})"
            )
        records = [self.record(index, entry) for index, entry in self._stream().take(split, n)]
        if split == "sft":
            for record in records:
                if record["answer"] is None:
                    raise UserError(
                        f"reasoning_gym:{self.task} has no reference answers (its verifier accepts any valid "
                        "solution), so there is no supervised warm start for it; set data.sft_epochs=0"
                    )
                record["completion"] = f"<answer>{record['answer']}</answer>"
        return records


class _Stream:
    """One task's problems in walk order, dealt to their splits as they are generated (a
    run asks for train, then eval, then sft problems: one walk serves them all)."""

    def __init__(self, task: ReasoningGymTask) -> None:
        self.task = task
        self.dataset = None
        self.next_index = 0
        self.found: dict[str, list[tuple[int, dict[str, Any]]]] = {s: [] for s in SPLITS}
        self.seen: dict[str, set[str]] = {s: set() for s in SPLITS}

    def _open(self):
        t = self.task
        try:
            with _quiet():
                return _import().create_dataset(t.task, seed=t.base_seed, size=t.window, **t.options)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - a generator that refuses these options
            raise UserError(f"reasoning_gym:{t.task}: could not create the dataset: {one_line_error(exc)}") from None

    def take(self, split: str, n: int) -> list[tuple[int, dict[str, Any]]]:
        found, t = self.found[split], self.task
        if len(found) < n and self.dataset is None:
            self.dataset = self._open()
        with _quiet():
            while len(found) < n:
                if self.next_index >= t.window:
                    raise UserError(
                        f"reasoning_gym:{t.task} gave only {len(found)} distinct {split} problems in the first "
                        f"{t.window} of seed {t.seed}; asked for {n} ({ASKED_BY[split]}): ask for fewer, or use "
                        "options that allow more distinct problems"
                    )
                index = self.next_index
                try:
                    entry = self.dataset[index]
                except Exception as exc:  # noqa: BLE001 - the generator failed on this problem
                    raise UserError(
                        f"reasoning_gym:{t.task}: the generator failed on problem {index} of seed {t.seed}: "
                        f"{one_line_error(exc)}"
                    ) from None
                self.next_index += 1
                if not isinstance(entry, dict) or not isinstance(entry.get("question"), str):
                    raise UserError(f"reasoning_gym:{t.task}: problem {index} has no question text")
                question = entry["question"]
                where = t.split_of(question)
                if question not in self.seen[where]:
                    self.seen[where].add(question)
                    self.found[where].append((index, entry))
        return found[:n]


_STREAMS: OrderedDict[tuple, _Stream] = OrderedDict()


# ---------------------------------------------------------------------------- verifier
_SCORERS: OrderedDict[tuple, Any] = OrderedDict()


def _scorer(task: str, seed: int, options: dict[str, Any]):
    """reasoning-gym's dataset for ``task`` with ``options``, for its ``score_answer``
    (created with size 1: scoring does not depend on the size; cached per process)."""
    key = (task, seed, repr(sorted(options.items())))
    dataset = _SCORERS.pop(key, None)
    if dataset is None:
        rg = _import()
        if task not in rg.factory.DATASETS:
            raise ValueError(f"reasoning_gym: {task!r} is not a reasoning-gym task")
        with _quiet():
            dataset = rg.create_dataset(task, seed=seed, size=1, **options)
    _SCORERS[key] = dataset
    while len(_SCORERS) > _SCORERS_KEPT:
        _SCORERS.popitem(last=False)
    return dataset


def extract_answer(response: str) -> str | None:
    """The text of the response's last ``<answer>...</answer>``, stripped (reasoning-gym's
    ``extract_answer``), or None when it has none."""
    return _import().utils.extract_answer(response, tag_name="answer", strip=True)


def reasoning_gym_reward(prompt: str, response: str, *, reasoning_gym: Any, **_: Any) -> tuple[float, str | None]:
    """The task's own ``score_answer`` of the response's answer (module docstring): a score
    in [0, 1], with the note ``no answer tags`` when the response has no ``<answer>`` tags
    (the task then scores ``None``, 0 for most tasks). ``reasoning_gym`` is the record's
    field of that name: ``{"task", "seed", "options", "entry"}``."""
    spec = reasoning_gym
    if not isinstance(spec, dict) or not isinstance(spec.get("task"), str) or not isinstance(spec.get("entry"), dict):
        raise ValueError(
            "the reasoning_gym field must be a dict with the task name and the item, as the "
            "reasoning_gym:<task> prompts have it"
        )
    dataset = _scorer(spec["task"], int(spec.get("seed") or 0), dict(spec.get("options") or {}))
    answer = extract_answer(response)
    score = dataset.score_answer(answer=answer, entry=spec["entry"])
    try:
        score = float(score)
    except (TypeError, ValueError):
        raise ValueError(f"reasoning_gym:{spec['task']}: score_answer returned {score!r}, not a number") from None
    if not math.isfinite(score):
        raise ValueError(f"reasoning_gym:{spec['task']}: score_answer returned {score}")
    return min(max(score, 0.0), 1.0), None if answer is not None else NO_ANSWER


def warm_up() -> None:
    """Import reasoning-gym before a reward worker's first sample (about a second)."""
    _import()
