"""Language-model workload: PPO on a Hugging Face causal LM, single- and multi-turn.

Sub-packages, grouped by concern:

- :mod:`.model`        loading (HF directories, the tiny model), the policy (LoRA actor and
  critic, value head, reference = adapters off), checkpoint files, device and precision,
  and :mod:`.model.stack`, the one recipe that builds a policy ready to run
- :mod:`.generation`   the rollout engine and loading a model to sample from
- :mod:`.data`         prompt records and formats, chat templates, built-in tasks
- :mod:`.rewards`      reward functions, math, the code sandbox, the worker pool, reward models
- :mod:`.single_turn`  the prompt workload: source, evaluator, how it is built
- :mod:`.multi_turn`   the text-environment workload: episodes, token streams, credit, self-play
- :mod:`.accel`        opt-in CPU acceleration; nothing else depends on it

Modules shared by both workloads:

- :mod:`.inputs`       a run's training prompts, held-out prompts and reward function (above
  :mod:`.data` and :mod:`.rewards`: it reads both)
- :mod:`.base_model`   the backbone a run trains: model.path, the tiny model, or a warm start
- :mod:`.sft`          the supervised warm start (SFT before RL)
- :mod:`.scoring`      old and reference log-probs, values and token rewards of a rollout
- :mod:`.learner`      the learner (optimizer, the shared PPO update, checkpoint files) and the scorer's set-up
- :mod:`.evaluate`     greedy held-out accuracy through the rollout engine
- :mod:`.run_eval`     ``ppokit eval`` of a language-model run or model directory (pass@k)

Nothing is imported here: ``import ppokit.lm`` must not load torch or transformers.
"""
