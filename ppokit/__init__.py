"""ppokit: Proximal Policy Optimization for language models and Gymnasium agents."""

import os as _os

__version__ = "0.1.0"

# ppokit's fused CPU kernels (ppokit.lm.kernels) split a large call over Python threads, on
# the cores PyTorch's OpenMP workers use too. By default those workers keep spinning for a
# while after each parallel region and hold the cores, so the kernel's threads ran one after
# the other (two threads: no faster than one). Workers that sleep when idle hand the cores
# over: the demo's iterations (two threads) took 1.04-1.09 s against 1.21-1.29 s. OpenMP reads
# this when PyTorch loads, so it applies when ppokit is imported first (the CLI always is); a
# value already set is kept.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
