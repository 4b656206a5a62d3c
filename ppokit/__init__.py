"""ppokit: Proximal Policy Optimization for language models and Gymnasium agents."""

import os as _os

__version__ = "0.1.0"

# PyTorch's OpenMP workers spin for several ms after each parallel region and hold the cores
# that the fused CPU kernels' threads (ppokit.lm.accel) need; a short spin hands them over
# (docs/performance.md, "Fused CPU kernels"). OpenMP reads these when PyTorch loads, so they
# apply when ppokit is imported first; a wait policy the user set is kept.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _os.environ.setdefault("GOMP_SPINCOUNT", "5000")
