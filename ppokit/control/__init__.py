"""The control workload: PPO on Gymnasium environments with MLP actor-critics.

- :mod:`.vector_env` ids to vector envs (spec, vectorization, NEXT_STEP autoreset), checks; no torch
- :mod:`.envs`      the run's vector env: normalization, episode stats
- :mod:`.networks`  MLP actor-critic (categorical / Gaussian), orthogonal init
- :mod:`.rollout`   preallocated [num_envs, num_steps] rollouts, masks, truncation bootstrap
- :mod:`.envstate`  snapshots of vector environments mid-episode, for exact resume
- :mod:`.workload`  the source, learner and evaluator of a control run
- :mod:`.evaluate`  deterministic evaluation, ``evaluate_run(run_dir, episodes)``, ``ppokit eval`` of a control run

Importing this package imports neither torch nor gymnasium; the modules do.
"""
