"""Single-turn PPO on prompts: one response per sample, scored by a reward function or model.

- :mod:`.workload`   builds the components of a prompt run (and checks its inputs first)
- :mod:`.source`     prompts in, scored responses out; rollout shards merged on the driver
- :mod:`.evaluator`  greedy held-out accuracy before, during and after training

Nothing is imported here: ``import ppokit.lm.single_turn`` does not load torch.
"""
