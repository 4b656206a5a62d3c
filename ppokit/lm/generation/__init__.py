"""Generation: the rollout engines that sample responses, and loading a model to sample from.

- :mod:`.engine`   the Hugging Face engine: ``generate`` with a KV cache, padded tensors and masks
- :mod:`.loading`  a trained actor or a model directory, ready to generate (``generate``, ``chat``, ``eval``)

Nothing is imported here: ``import ppokit.lm.generation`` does not load torch.
"""
