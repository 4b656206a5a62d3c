"""Single-turn PPO on prompts: one response per sample, scored by a reward function or model.

- :mod:`.workload`  the source, learner and evaluator of a prompt run, and how they are built

Nothing is imported here: ``import ppokit.lm.single_turn`` does not load torch.
"""
