"""Multi-turn PPO on text environments: episodes of many turns, credit by token or by turn.

- :mod:`.workload`        the components of a multi-turn run
- :mod:`.sizing`          an iteration's sequences, probed in the environment before the run
- :mod:`.demonstrations`  the warm start from demonstrations played in the environment
- :mod:`.advantages`      credit over each trajectory's action tokens (token or turn GAE)
- :mod:`.source`      the rollout source and the evaluator (greedy win rates)
- :mod:`.run_eval`    ``ppokit eval`` of a multi-turn run: its greedy win rates
- :mod:`.shards`      episodes on Ray rollout workers: each worker's share, merged in episode order
- :mod:`.episodes`    many episodes played at once, batched generation across them
- :mod:`.streams`     each seat's token stream: sampled tokens, observations appended
- :mod:`.turn_batch`  trajectories as the single-turn batch layout with an action mask
- :mod:`.opponents`   past actor adapters kept as self-play opponents

Nothing is imported here: ``import ppokit.lm.multi_turn`` does not load torch.
"""
