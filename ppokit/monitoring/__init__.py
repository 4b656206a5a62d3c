"""What a run reports about itself while it trains, and the rules that stop it on what it sees.

- :mod:`.track`: ``metrics.jsonl``, ``samples.jsonl``, TensorBoard, wandb and the progress bar;
- :mod:`.plot`: the curves of one or more runs (``ppokit plot``);
- :mod:`.peak_memory`: each phase's peak memory (the CUDA allocator's, or the resident peak);
- :mod:`.health`: the warnings of a run that cannot learn or runs away;
- :mod:`.stopping`: stopping on periodic evaluations (a target, or a patience without a new best).
"""
