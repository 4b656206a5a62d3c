"""Generation: the rollout engines that sample responses, and loading a model to sample from.

- :mod:`.base`     the seam: the ``RolloutEngine`` protocol, ``RolloutBatch``, the sampled distribution
- :mod:`.factory`  ``make_engine``: the engine ``rollout.engine`` names (hf, cuda, auto)
- :mod:`.engine`   the Hugging Face engine: ``generate`` with a KV cache, padded tensors and masks
- :mod:`.cuda_engine`  the CUDA engine: its own folded weights, a KV cache allocated once, decoding
  steps captured in CUDA graphs (eager on the CPU); ``rollout.engine=auto``'s choice on CUDA
- :mod:`.decoder`  the CUDA engine's model-agnostic forward for Llama/Qwen2/Qwen3/Mistral decoders
- :mod:`.loading`  a trained actor or a model directory, ready to generate (``generate``, ``chat``, ``eval``)

Nothing is imported here: ``import ppokit.lm.generation`` does not load torch.
"""
