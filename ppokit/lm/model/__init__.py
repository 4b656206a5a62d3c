"""The language model itself: loading, the policy, its checkpoints, where it runs.

- :mod:`.hf`          local Hugging Face model directories and tokenizers: the one loader
- :mod:`.gguf`        GGUF model files, converted once into a Hugging Face directory
- :mod:`.model_path`  what a model path names (run, checkpoint, model directory, GGUF file), without torch
- :mod:`.tiny`        a tiny Llama-style model and character tokenizer, built here (no downloads)
- :mod:`.policy`      the policy: LoRA actor and critic on one backbone (or full models),
  the value head, the reference as the backbone with adapters off
- :mod:`.heads`       a causal LM's body and output layer apart: logits at chosen positions only
- :mod:`.checkpoint`  the policy's checkpoint files, written and read back
- :mod:`.device`      ``run.device``, ``run.precision``, the attention kernel, torch threads
- :mod:`.stack`       a policy ready to train or sample: device, tokenizer, policy, CPU kernels, threads
- :mod:`.memory`      a run's memory estimated from the config and the model's shape; refusing what cannot fit

Nothing is imported here: ``import ppokit.lm.model`` does not load torch.
"""
