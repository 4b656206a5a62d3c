"""Single-turn PPO on prompts: one response per sample, scored by a reward function or model.

- :mod:`.workload`   builds the components of a prompt run (and checks its inputs first)
- :mod:`.source`     prompts in, scored responses out; rollout shards merged on the driver
- :mod:`.dynamic_sampling` DAPO's dynamic sampling: more generation batches until the groups
  with reward variance fill the batch (``rollout.dynamic_sampling``)
- :mod:`.evaluator`  greedy held-out accuracy before, during and after training

Nothing is imported here: ``import ppokit.lm.single_turn`` does not load torch.
"""
