"""Language-model workload: PPO on a Hugging Face causal LM.

The modules, in the order one iteration meets them:

- :mod:`ppokit.lm.model.tiny`     a tiny Llama-style model and a character tokenizer, built
  locally (no downloads) in Hugging Face format: the embedded default policy.
- :mod:`ppokit.lm.data.tasks`    built-in procedural tasks (arithmetic) with disjoint
  SFT / RL / held-out splits.
- :mod:`ppokit.lm.data.sources`     prompt data (a built-in task or a JSONL file) and the
  resumable iterator that hands out fresh prompts each iteration.
- :mod:`ppokit.lm.rewards.functions`  reward functions: plain ``(prompt, response, **fields) ->
  float`` callables, built-in or loaded from ``module:fn`` / ``file.py:fn``.
- :mod:`ppokit.lm.sft`      supervised warm start (SFT before RL) and the greedy
  held-out evaluation the PPO workload reuses.

Nothing is imported here: ``import ppokit.lm`` must not load torch or transformers.
"""
