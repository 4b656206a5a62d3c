"""Loading a user's object by spec: ``package.module:name`` or ``path/to/file.py:name``.

Reward functions (:mod:`ppokit.lm.rewards.functions`) and text environments (:mod:`ppokit.envs`)
are named this way in a config. Every problem (a module that cannot be imported, a file
that is missing or fails when it runs, a missing attribute) is a one-line error of the
caller's class that names the spec and the fix; an error inside the user's module is the
user's, so its message is shown on one line, not as a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from ppokit.errors import UserError, did_you_mean

__all__ = ["is_user_spec", "load_user_object", "one_line_error"]


def one_line_error(exc: BaseException) -> str:
    """``"ValueError: bad input"``: the exception's type and the first line of its message
    (a syntax error's line number; ``sys.exit`` as what it is)."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    text = message.strip().splitlines()
    where = ""
    if isinstance(exc, SyntaxError) and exc.lineno:
        where = f" (line {exc.lineno})"
        text = [exc.msg]
    return f"{type(exc).__name__}: {text[0] if text else ''}{where}".rstrip(": ")


def is_user_spec(spec: str) -> bool:
    """Whether ``spec`` looks like ``module:name`` or ``file.py:name`` (not a built-in name)."""
    target, sep, attr = spec.rpartition(":")
    return bool(sep and target and attr)


def load_user_object(
    spec: str,
    *,
    what: str,
    kind: str,
    fix: str,
    error: type[UserError] = UserError,
    candidates: Callable[[Any], bool] = callable,
) -> Any:
    """The object ``spec`` names (``module:name`` or ``path/to/file.py:name``).

    ``what`` names the thing in messages ("reward function", "environment"), ``kind`` what
    ``name`` should be ("function", "class") and ``fix`` what a right one looks like;
    ``candidates`` picks the attributes a near-miss is compared with.
    """
    target, _, attr = spec.rpartition(":")
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    module = _import_file(spec, target, what, error) if is_file else _import_module(spec, target, what, kind, error)
    if not hasattr(module, attr):
        names = [n for n in vars(module) if not n.startswith("_") and candidates(getattr(module, n))]
        hint = did_you_mean(attr, names)
        listing = "" if hint else (f" ({kind}s there: {', '.join(sorted(names)[:10])})" if names else "")
        raise error(f"{what} '{spec}': {target} has no attribute '{attr}'{hint}{listing}")
    obj = getattr(module, attr)
    if not callable(obj):
        raise error(f"{what} '{spec}': {attr} is a {type(obj).__name__}, not a {kind}; {fix}")
    return obj


def _import_module(spec: str, name: str, what: str, kind: str, error: type[UserError]) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise error(
                f"{what} '{spec}': cannot import module '{name}' (no module named '{exc.name}'); check the "
                f"name, install it, or give path/to/file.py:{kind}"
            ) from None
        raise error(f"{what} '{spec}': importing '{name}' failed: {one_line_error(exc)}") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any error in the user's module is the user's
        raise error(f"{what} '{spec}': importing '{name}' failed: {one_line_error(exc)}") from None


def _import_file(spec: str, path_text: str, what: str, error: type[UserError]) -> ModuleType:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise error(f"{what} '{spec}': file {path} does not exist")
    module_name = f"ppokit_user_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{what} '{spec}': cannot load {path} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # lets dataclasses and pickle inside the file work
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        sys.modules.pop(module_name, None)
        raise error(f"{what} '{spec}': running {path} failed: {one_line_error(exc)}") from None
    return module
