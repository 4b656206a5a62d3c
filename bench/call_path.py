"""The path a ppokit command takes through ppokit's modules: how many it visits, how often it returns.

    python bench/call_path.py eval RUN_DIR            # any `ppokit` command line
    python bench/call_path.py --json out.json eval RUN_DIR
    python bench/call_path.py --until LMSource.collect train arith   # up to the first rollout

It runs the command in this process under ``sys.setprofile`` and records every call of a
ppokit function by its module. Consecutive calls in one module count once; a *return* is an
entry into a module the path had already left. Views, each from the one before:

- ``all``: every call (module bodies themselves not counted);
- ``no-imp``: without the calls made while a module body runs (import-time registration);
- ``path``: without the model's own calls (anything beneath a ``torch.nn.Module`` call);
- ``run``: ``path`` from the command's ``run()`` on (the parsers' set-up left out);
- ``run-m``: ``run`` without the calls beneath ``ppokit.lm.accel`` (the CPU acceleration of a
  loaded model), which counts as one module.

It prints each view's module count, returns and module order, and how often the functions that
read a run directory ran (:data:`READERS`). ``--until QUALNAME``: the path up to the first call of
that function (its own call included), the command stopped there.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
from typing import Any

READERS = ("saved_config", "latest_checkpoint", "find_checkpoints", "read_run_config", "read_policy_meta")


class Reached(Exception):
    """The function of ``--until`` was called: the command stops there."""


class Recorder:
    """The ppokit calls of a command: (module, at import, beneath a model call, beneath accel, function)."""

    def __init__(self, until: str | None = None) -> None:
        self.events: list[tuple[str, bool, bool, bool, str]] = []
        self.until = until

    def __call__(self, frame, event, arg) -> None:
        if event != "call" or self.until == "":
            return
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("ppokit") or frame.f_code.co_name == "<module>":
            return
        imported = model = accel = False
        caller = frame.f_back
        while caller is not None:
            code, module = caller.f_code, caller.f_globals.get("__name__", "")
            if code.co_name == "<module>" and module != "__main__":
                imported = True
            elif code.co_name in ("_call_impl", "_wrapped_call_impl") and "torch" in code.co_filename:
                model = True
            elif module.startswith("ppokit.lm.accel"):
                accel = True
            caller = caller.f_back
        self.events.append((name, imported, model, accel, frame.f_code.co_qualname))
        if self.until and frame.f_code.co_qualname == self.until:
            self.until = ""  # record nothing more
            raise Reached(self.until)


def module_entries(events: list[tuple], rename=lambda module: module) -> list[tuple[str, str]]:
    """``(module, first function called there)`` for each entry into a module, in call order:
    consecutive calls in one module count once."""
    sequence: list[tuple[str, str]] = []
    for event in events:
        module = rename(event[0])
        if not sequence or sequence[-1][0] != module:
            sequence.append((module, event[4]))
    return sequence


def collapse(events: list[tuple], rename=lambda module: module) -> list[str]:
    """The modules in call order, consecutive calls in one module counted once."""
    return [module for module, _ in module_entries(events, rename)]


def entries(events: list[tuple], rename=lambda module: module) -> list[str]:
    """Each entry as ``module:function``, marked ``<`` where it returns to a module the path had
    left: the sequence :func:`stats` counts."""
    out: list[str] = []
    seen: set[str] = set()
    for module, function in module_entries(events, rename):
        out.append(f"{'< ' if module in seen else ''}{module.removeprefix('ppokit.')}:{function}")
        seen.add(module)
    return out


def stats(sequence: list[str]) -> dict[str, Any]:
    """Distinct modules, entries, returns (entries into a module seen before) and the first-seen order."""
    seen: list[str] = []
    returns = 0
    for module in sequence:
        if module in seen:
            returns += 1
        else:
            seen.append(module)
    return {"modules": len(seen), "entries": len(sequence), "returns": returns, "order": seen}


def views(events: list[tuple]) -> dict[str, Any]:
    """The five views of the module docstring, and the run-directory reads of the ``run`` view."""
    no_imp = [e for e in events if not e[1]]
    path = [e for e in no_imp if not e[2]]
    start = next((i for i, e in enumerate(path) if e[0].startswith("ppokit.commands.") and e[4] == "run"), 0)
    run = path[start:]
    run_m = [e for e in run if not e[3]]

    def accel(module: str) -> str:
        return "ppokit.lm.accel" if module.startswith("ppokit.lm.accel") else module

    reads = collections.Counter(f"{e[0].removeprefix('ppokit.')}.{e[4]}" for e in run if e[4].split(".")[-1] in READERS)
    return {
        "all": stats(collapse(events)),
        "no-imp": stats(collapse(no_imp)),
        "path": stats(collapse(path)),
        "run": stats(collapse(run)),
        "run-m": stats(collapse(run_m, accel)),
        "run-m entries": entries(run_m, accel),
        "reads": dict(reads),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the views to this file")
    parser.add_argument("--until", help="stop at the first call of this function (e.g. LMSource.collect)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the ppokit command line")
    args = parser.parse_args(argv)
    from ppokit.cli import main as ppokit_main  # noqa: PLC0415 (its imports are part of what is traced)

    recorder = Recorder(args.until)
    sys.setprofile(recorder)
    threading.setprofile(recorder)
    try:
        status = ppokit_main(args.command)
    except SystemExit as exc:
        status = exc.code
    except Reached:
        status = f"stopped at {args.until}"
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    result = {"status": status, **views(recorder.events)}
    for name in ("all", "no-imp", "path", "run", "run-m"):
        view = result[name]
        print(f"{name:7s} {view['modules']:3d} modules, {view['returns']:4d} returns", file=sys.stderr)
    print(f"run-m order: {' > '.join(m.removeprefix('ppokit.') for m in result['run-m']['order'])}", file=sys.stderr)
    print(f"run-directory reads: {result['reads']}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
