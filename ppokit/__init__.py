"""ppokit: Proximal Policy Optimization for language models and Gymnasium agents."""

__version__ = "0.1.0"
