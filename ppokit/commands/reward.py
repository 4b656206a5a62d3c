"""Try a reward function on one response: what ``ppokit reward NAME --prompt ... --response ...`` runs.

::

    ppokit reward math --prompt "What is 1/2 + 0?" --response "\\boxed{0.5}" --field answer=1/2
    ppokit reward my_rewards.py:strict --prompt p --response 7 --field answer=7 --field tags='["a", "b"]'

``NAME`` is a built-in (``exact_match``, ``numeric_match``, ``math``, ``code``,
``countdown``) or ``module:fn`` / ``file.py:fn``. The function runs as in training: the
cheap built-ins in this process, the others in a reward worker with the time limit, so a
raise or a hang shows as the reason instead of a traceback.

Field values given as text are read as JSON when they parse (``[1, 2]``, ``{"a": 1}``,
``true``, ``null``, ``42``), else kept as the text; a number keeps its text when JSON
would change how it is written (``1.50`` stays ``"1.50"``, ``007`` stays ``"007"``), so
``exact_match`` compares what was typed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ppokit.commands.arguments import add_command, positive_float
from ppokit.errors import UserError

RESERVED = ("prompt", "response")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "reward",
        run,
        help="score one response with a reward function (debug a verifier)",
        description="Run the reward function NAME on one prompt and response as training "
        "does (in a worker process with a time limit, except the cheap built-ins) "
        "and print the score and, when there is one, the reason for it or the "
        "failure. Exit status 0 when scored, 2 for bad arguments.",
    )
    parser.add_argument(
        "name",
        metavar="NAME",
        help="a built-in (exact_match, numeric_match, math, code, countdown), module:fn or file.py:fn",
    )
    parser.add_argument("--prompt", required=True, metavar="TEXT")
    parser.add_argument("--response", required=True, metavar="TEXT")
    parser.add_argument(
        "--field",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a data field for the function (JSON values are parsed: --field tests='[...]')",
    )
    parser.add_argument("--timeout", type=positive_float, default=30.0, help="seconds before it counts as hung")


def run(args: argparse.Namespace) -> int:
    score, reason = reward_main(args.name, args.prompt, args.response, args.field, timeout=args.timeout)
    print(f"score: {score:g}")
    if reason:
        print(f"reason: {reason}")
    return 0


def parse_value(text: str) -> Any:
    """A field value typed as text: JSON when it parses (and a number only when JSON writes it
    the same way), else the text itself."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text
    if isinstance(value, (int, float)) and not isinstance(value, bool) and json.dumps(value) != text.strip():
        return text
    return value


def parse_field_args(items: Sequence[str]) -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` (``--field`` arguments) as a fields dict, values by :func:`parse_value`."""
    fields: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--field {item!r}: write it as KEY=VALUE, e.g. --field answer=42")
        if key in RESERVED:
            raise UserError(f"--field {key}: the {key} is given with --{key}, not as a field")
        if key in fields:
            raise UserError(f"--field {key} is given twice")
        fields[key] = parse_value(value)
    return fields


def reward_main(
    name: str, prompt: str, response: str, fields: Mapping[str, Any] | Sequence[str] = (), *, timeout: float = 30.0
) -> tuple[float, str | None]:
    """``(score, reason or None)`` of the reward ``name`` on one response.

    ``fields``: a dict (text values parsed by :func:`parse_value`) or ``KEY=VALUE``
    strings. ``reason``: the reason the function returned with its score, or, when it
    failed, ``"<kind>: <what happened>"`` (kind ``error``, ``bad_value``, ``timeout``,
    ``worker_died``) with the score then 0. A bad ``name`` is a :class:`UserError`.
    """
    from ppokit.lm.rewards.pool import make_reward_scorer

    if isinstance(fields, Mapping):
        for key in fields:
            if key in RESERVED:
                raise UserError(f"field {key}: the {key} is given on its own, not as a field")
        parsed = {k: parse_value(v) if isinstance(v, str) else v for k, v in fields.items()}
    else:
        parsed = parse_field_args(list(fields))
    scorer = make_reward_scorer(name, num_workers=1, timeout=timeout, max_reward_errors=None)
    try:
        results = scorer.score([prompt], [response], [parsed])
    finally:
        scorer.close()
    error = results.errors[0]
    if error is not None:
        return results.scores[0], f"{error[0]}: {error[1]}"
    return results.scores[0], results.notes[0]
