"""MLP actor-critic for Gymnasium tasks, in the style of CleanRL's ``ppo.py`` /
``ppo_continuous_action.py``.

Discrete actions: ``Categorical(logits=policy_head(h))``. Box actions: a diagonal
Gaussian ``Normal(policy_head(h), exp(log_std))`` whose log standard deviation is a free,
state-independent parameter (``network.init_log_std``); log-prob and entropy are summed
over the action dimensions. The sample that is stored and trained on is the unclipped
one; ``VecEnv.step`` clips to the Box bounds.

Layout (the names are the checkpoint's tensor names: ``actor.0.weight``, ``actor.2.bias``,
... for the hidden layers, which sit at the even indices of their ``nn.Sequential``)::

    separate trunks (default)            shared trunk (network.shared_trunk)
    actor:  Linear, act, Linear, act     trunk: Linear, act, Linear, act
    policy_head: Linear(H, A)            policy_head: Linear(H, A)
    log_std: (A,)  [Box actions only]    log_std: (A,)  [Box actions only]
    critic: Linear, act, Linear, act     value_head: Linear(H, 1)
    value_head: Linear(H, 1)

Init (``network.ortho_init``, CleanRL's ``layer_init``): orthogonal weights with gain
sqrt(2) for hidden layers, 0.01 for the policy head (a near-uniform first policy) and
1.0 for the value head, biases 0. Without it, PyTorch's default ``nn.Linear`` init.

Sampling draws only from the global torch RNG (Gumbel noise for discrete actions, see
:meth:`ActorCritic.act`; ``torch.normal`` for Box actions), so a run restored with its RNG
state continues bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributions import Categorical, Distribution, Normal

from ppokit.config import Config, NetworkConfig

ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}


def layer_init(layer: nn.Linear, gain: float) -> nn.Linear:
    """Orthogonal weight scaled by ``gain`` (all its singular values equal ``gain``), zero bias."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class ActorCritic(nn.Module):
    """MLP policy and value function; the ``policy`` object of :class:`ppokit.trainer.PPOTrainer`."""

    autocast_dtype = None  # float32 throughout
    compute_device = None  # the passes run where the weights are

    def __init__(self, obs_dim: int, action_dim: int, discrete: bool, net: NetworkConfig):
        super().__init__()
        self.obs_dim = obs_dim
        self.action_dim = action_dim
        self.discrete = discrete
        self.shared = net.shared_trunk
        init = layer_init if net.ortho_init else (lambda layer, gain: layer)

        def mlp() -> nn.Sequential:
            """Hidden layers: (..., obs_dim) -> (..., hidden_sizes[-1])."""
            layers: list[nn.Module] = []
            n_in = obs_dim
            for width in net.hidden_sizes:
                layers += [init(nn.Linear(n_in, width), math.sqrt(2)), ACTIVATIONS[net.activation]()]
                n_in = width
            return nn.Sequential(*layers)

        hidden = net.hidden_sizes[-1]
        # Creation order = RNG draw order = checkpoint order: actor side first, then critic.
        if self.shared:
            self.trunk = mlp()
        else:
            self.actor = mlp()
        self.policy_head = init(nn.Linear(hidden, action_dim), 0.01)
        if not discrete:
            self.log_std = nn.Parameter(torch.full((action_dim,), float(net.init_log_std)))
        if not self.shared:
            self.critic = mlp()
        self.value_head = init(nn.Linear(hidden, 1), 1.0)

    # ------------------------------------------------------------------ trainer API
    def param_groups(self, cfg: Config) -> list[dict[str, Any]]:
        """Actor (trunk if shared, policy head, log-std) and critic (critic trunk, value head)
        groups with their learning rates."""
        actor = [*(self.trunk if self.shared else self.actor).parameters(), *self.policy_head.parameters()]
        if not self.discrete:
            actor.append(self.log_std)
        critic = [*([] if self.shared else self.critic.parameters()), *self.value_head.parameters()]
        lr = cfg.train.learning_rate
        return [
            {"params": actor, "lr": lr, "name": "actor"},
            {"params": critic, "lr": cfg.train.critic_learning_rate or lr, "name": "critic"},
        ]

    def evaluate(self, micro_batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """log_prob, values, entropy (n, T) of ``obs`` (n, T, D) and ``actions`` (n, T[, A])."""
        dist, values = self._dist_and_value(micro_batch["obs"])
        return {
            "log_prob": self._log_prob(dist, micro_batch["actions"]),
            "values": values,
            "entropy": self._entropy(dist),
        }

    @staticmethod
    def compact(micro_batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The micro-batch as it is: transitions have no padding columns."""
        return micro_batch

    def refresh_parameters(self) -> None:
        """Nothing cached: the optimizer reads :meth:`param_groups` after sharding."""

    # ------------------------------------------------------------------ rollout API
    def act(self, obs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Sample actions for obs (E, D): ``(actions (E,) or (E, A), log_prob (E,), value (E,))``.

        Discrete actions are drawn with the Gumbel-max trick, ``argmax(log p + G)`` with
        ``G = -log(Exp(1))``: exactly a draw from ``Categorical(logits)``, in one noise tensor
        and an argmax, where building a ``Categorical`` and its ``multinomial`` draw made a
        CartPole run 1.2-1.4x slower (docs/performance.md). The update's log-probs and
        entropy come from ``Categorical`` (:meth:`evaluate`).
        """
        out, values = self._head_and_value(obs)
        if self.discrete:
            log_p = torch.log_softmax(out, dim=-1)  # (E, K)
            actions = (log_p - torch.empty_like(log_p).exponential_().log_()).argmax(-1)  # (E,)
            return actions, log_p.gather(-1, actions[:, None]).squeeze(-1), values
        dist = self._dist(out)
        actions = dist.sample()  # (E, A)
        return actions, self._log_prob(dist, actions), values

    def act_deterministic(self, obs: Tensor) -> Tensor:
        """The mode: argmax of the logits, or the Gaussian mean."""
        out = self.policy_head(self._actor_features(obs))  # (E, A): logits or mean
        return out.argmax(-1) if self.discrete else out

    def value(self, obs: Tensor) -> Tensor:
        """V(obs) (E,)."""
        h = self.trunk(obs) if self.shared else self.critic(obs)
        return self.value_head(h).squeeze(-1)

    # ------------------------------------------------------------------ named state
    def named_state(self) -> dict[str, Tensor]:
        """The tensors by name (``actor.0.weight``, ..., ``value_head.bias``), copied, for checkpoints."""
        return {name: t.detach().clone() for name, t in self.state_dict().items()}

    def load_named_state(self, state: dict[str, Tensor]) -> None:
        """Inverse of :meth:`named_state`; ValueError on a missing, extra or misshapen tensor."""
        expected = {name: tuple(t.shape) for name, t in self.state_dict().items()}
        if set(state) != set(expected):
            missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            raise ValueError(f"network layers differ (missing {missing}, unexpected {extra})")
        for name, shape in expected.items():
            if tuple(state[name].shape) != shape:
                raise ValueError(f"'{name}' has shape {tuple(state[name].shape)}, the config makes {shape}")
        self.load_state_dict(state)

    # ------------------------------------------------------------------ internals
    def _actor_features(self, obs: Tensor) -> Tensor:
        return self.trunk(obs) if self.shared else self.actor(obs)

    def _head_and_value(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """The policy head's output (logits or mean, (..., A)) and V(obs) (...)."""
        if self.shared:
            h_actor = h_critic = self.trunk(obs)  # (..., H)
        else:
            h_actor, h_critic = self.actor(obs), self.critic(obs)
        return self.policy_head(h_actor), self.value_head(h_critic).squeeze(-1)

    def _dist(self, out: Tensor) -> Distribution:
        # validate_args=False: the arguments come from our own layers (always a valid
        # parameterisation) and the actions from our own sampler or rollout buffers, while
        # the checks add ops to every rollout step and mini-batch (docs/performance.md).
        if self.discrete:
            return Categorical(logits=out, validate_args=False)
        return Normal(out, self.log_std.exp(), validate_args=False)

    def _dist_and_value(self, obs: Tensor) -> tuple[Distribution, Tensor]:
        """The action distribution and V(obs), batch shape obs.shape[:-1]."""
        out, values = self._head_and_value(obs)
        return self._dist(out), values

    def _log_prob(self, dist: Distribution, actions: Tensor) -> Tensor:
        """log pi(a|s), batch shape; Box actions: summed over the action dimensions."""
        log_prob = dist.log_prob(actions)
        return log_prob if self.discrete else log_prob.sum(-1)

    def _entropy(self, dist: Distribution) -> Tensor:
        """H(pi(.|s)), batch shape; Box actions: summed over the action dimensions."""
        entropy = dist.entropy()
        return entropy if self.discrete else entropy.sum(-1)
