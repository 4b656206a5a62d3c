"""What the ``ppokit`` command runs, above the library: each module is one command.

- :mod:`.demo`         ``ppokit demo [NAME]``
- :mod:`.evaluate`     ``ppokit eval`` for a language model (control: :mod:`ppokit.control.evaluate`)
- :mod:`.export`       ``ppokit export``
- :mod:`.interactive`  ``ppokit generate`` and ``ppokit chat``
- :mod:`.reward`       ``ppokit reward``
- :mod:`.sft`          ``ppokit sft``

Nothing is imported here: ``ppokit --help`` does not load torch.
"""
