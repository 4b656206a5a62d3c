"""The ``ppokit`` commands, above the library: each module is one command (``interactive``: two).

Each command module has ``add_parser(subparsers)``, which adds its parser and sets ``run``, the
function that runs it (``run(args)`` -> exit status); :mod:`ppokit.cli` registers them in order.

- :mod:`.arguments`    what the parsers share: argument types, sampling options, one-line usage errors
- :mod:`.train`        ``ppokit train``
- :mod:`.evaluate`     ``ppokit eval`` (each workload kind's evaluation: :data:`ppokit.workloads.EVALUATORS`)
- :mod:`.interactive`  ``ppokit generate`` and ``ppokit chat``
- :mod:`.reward`       ``ppokit reward``
- :mod:`.demo`         ``ppokit demo [NAME]``
- :mod:`.sft`          ``ppokit sft``
- :mod:`.plot`         ``ppokit plot`` (the drawing: :mod:`ppokit.monitoring.plot`)
- :mod:`.export`       ``ppokit export``
- :mod:`.config`       ``ppokit config show|list|fields``

Nothing heavy is imported at a module's top: ``ppokit --help`` adds every parser and loads no
torch; what a command needs is imported when it runs.
"""
