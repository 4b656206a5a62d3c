"""Prompt data of a language-model run: records, formats, chat templates, built-in tasks.

- :mod:`.sources`    a built-in task or the user's file, and the resumable prompt iterator
- :mod:`.records`    JSONL, Parquet and ``datasets`` directories, checked record by record
- :mod:`.chat`       prompts rendered with the tokenizer's chat template
- :mod:`.tasks`      the built-in procedural tasks (arithmetic) and the task registry
- :mod:`.splits`     disjoint held-out, warm-start and training splits by a fixed hash
- :mod:`.countdown`  the Countdown task
- :mod:`.gsm8k`      GSM8K-format data from the user's file
- :mod:`.reasoning_gym`  reasoning-gym's procedural tasks (optional package) and their verifier

Nothing is imported here: ``import ppokit.lm.data`` does not load torch.
"""
