"""Rewards of language-model responses: functions, verifiers, the worker pool, reward models.

- :mod:`.functions`     reward functions ``(prompt, response, **fields) -> float``: built-ins and the user's
- :mod:`.math_answers`  the ``math`` reward (math-verify)
- :mod:`.sandbox`       the ``code`` reward: programs run against tests, isolated
- :mod:`.pool`          worker processes with a time limit per sample and counted failures
- :mod:`.reward_model`  a sequence-classification model whose one output is the reward
- :mod:`.shaping`       pure shaping functions on sequence rewards
- :mod:`.sequence`      each response's sequence reward: sources, weights, shaping, failures

Nothing is imported here: ``import ppokit.lm.rewards`` does not load torch.
"""
