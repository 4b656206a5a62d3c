"""ppokit: Proximal Policy Optimization for language models and Gymnasium agents."""

import os as _os

__version__ = "0.1.0"

# ppokit's fused CPU kernels (ppokit.lm.accel.kernels) split a large call over Python threads, on
# the cores PyTorch's OpenMP workers use too. By default (GNU OpenMP, as in PyTorch's Linux
# wheels) those workers spin for 300,000 rounds (several ms) after each parallel region and
# hold the cores, so the kernel's threads ran one after the other. Workers that sleep at once
# (OMP_WAIT_POLICY=PASSIVE) hand the cores over but cost every parallel operation a wake-up:
# 55 us for a torch.sqrt of 1,024 floats on two threads, against 2.5 us. A short spin
# (GOMP_SPINCOUNT=5000 rounds: 0.13-0.15 ms on the AMD EPYC) keeps both: the demo's update on
# two threads took 0.32-0.42 s against 0.41-0.50 s passive (docs/performance.md, "Fused CPU kernels").
# OpenMP reads these when PyTorch loads, so they apply when ppokit is imported first (the CLI
# always is); a wait policy the user set is kept, and with it OpenMP's own spin count.
if "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _os.environ.setdefault("GOMP_SPINCOUNT", "5000")
