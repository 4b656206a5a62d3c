"""MLP actor-critic for Gymnasium tasks.

Discrete actions: a categorical policy over logits. Box actions: a diagonal Gaussian
whose mean is the policy head's output and whose log standard deviation is a free
parameter (state independent, ``network.init_log_std``). The sample that is stored and
trained on is the unclipped one; ``VecEnv.step`` clips to the Box bounds.

Actor and critic are separate MLPs, or share their hidden layers
(``network.shared_trunk``). Orthogonal init (``network.ortho_init``) with per-layer
gains: sqrt(2) for hidden layers, 0.01 for the policy head (near-uniform first policy),
1.0 for the value head; biases 0.

A small MLP on a CPU is paid for in per-call overhead, not FLOPs. So:

- the parameters live in two flat tensors, ``actor_params`` (trunk when shared, policy
  head, log-std) and ``critic_params`` (trunk, value head): the optimizer, gradient
  clipping and ``zero_grad`` touch 2 tensors instead of 10-13 (about 1 ms less per
  optimizer step on a 2-core machine). Each forward pass views the layers out of them
  (``split`` + ``view``; cached when no gradient is recorded); checkpoints store the named layers
  (:meth:`named_state` / :meth:`load_named_state`), not the flat vectors;
- the forward pass calls ``F.linear`` directly instead of ``nn.Module`` layers;
- categorical sampling is Gumbel-max, and the log-prob / entropy formulas are written
  out instead of ``torch.distributions``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppokit.config import Config, NetworkConfig

ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu, "gelu": F.gelu}
LOG_2PI = math.log(2 * math.pi)


def _init_linear(n_in: int, n_out: int, gain: float, ortho: bool) -> tuple[Tensor, Tensor]:
    """(weight (n_out, n_in), bias (n_out,)): orthogonal with ``gain`` and zero bias, or PyTorch's default."""
    layer = nn.Linear(n_in, n_out)
    if ortho:
        nn.init.orthogonal_(layer.weight, gain)
        nn.init.zeros_(layer.bias)
    return layer.weight.detach(), layer.bias.detach()


class _FlatGroup:
    """Named tensors packed into one flat vector: the layout, packing and views."""

    def __init__(self, tensors: list[tuple[str, Tensor]]):
        self.names = [name for name, _ in tensors]
        self.shapes = [tuple(t.shape) for _, t in tensors]
        self.sizes = [t.numel() for _, t in tensors]
        self.initial = torch.cat([t.reshape(-1) for _, t in tensors]) if tensors else torch.zeros(0)

    def views(self, flat: Tensor) -> list[Tensor]:
        return [chunk.view(shape) for chunk, shape in zip(flat.split(self.sizes), self.shapes)]


class ActorCritic(nn.Module):
    """MLP policy and value function; the ``policy`` object of :class:`ppokit.trainer.PPOTrainer`."""

    def __init__(self, obs_dim: int, action_dim: int, discrete: bool, net: NetworkConfig):
        super().__init__()
        self.obs_dim = obs_dim
        self.action_dim = action_dim
        self.discrete = discrete
        self.shared = net.shared_trunk
        self.depth = len(net.hidden_sizes)
        self.act_fn = ACTIVATIONS[net.activation]
        ortho, root2 = net.ortho_init, math.sqrt(2)

        def trunk(prefix: str) -> list[tuple[str, Tensor]]:
            out, n_in = [], obs_dim
            for i, width in enumerate(net.hidden_sizes):
                w, b = _init_linear(n_in, width, root2, ortho)
                out += [(f"{prefix}.{i}.weight", w), (f"{prefix}.{i}.bias", b)]
                n_in = width
            return out

        last = net.hidden_sizes[-1]
        actor = trunk("trunk" if self.shared else "actor")
        w, b = _init_linear(last, action_dim, 0.01, ortho)
        actor += [("policy_head.weight", w), ("policy_head.bias", b)]
        if not discrete:
            actor.append(("log_std", torch.full((action_dim,), float(net.init_log_std))))
        critic = [] if self.shared else trunk("critic")
        w, b = _init_linear(last, 1, 1.0, ortho)
        critic += [("value_head.weight", w), ("value_head.bias", b)]
        self._actor = _FlatGroup(actor)
        self._critic = _FlatGroup(critic)
        self.actor_params = nn.Parameter(self._actor.initial.clone())
        self.critic_params = nn.Parameter(self._critic.initial.clone())

    # ------------------------------------------------------------------ trainer API
    def param_groups(self, cfg: Config) -> list[dict[str, Any]]:
        """Actor (trunk if shared, policy head, log-std) and critic groups with their learning rates."""
        lr = cfg.train.learning_rate
        return [{"params": [self.actor_params], "lr": lr, "name": "actor"},
                {"params": [self.critic_params], "lr": cfg.train.critic_learning_rate or lr, "name": "critic"}]

    def evaluate(self, micro_batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """log_prob, values, entropy (n, T) of ``obs`` (n, T, D) and ``actions`` (n, T[, A])."""
        obs = micro_batch["obs"]
        n, t = obs.shape[:2]
        actions = micro_batch["actions"].reshape(n * t, *micro_batch["actions"].shape[2:])
        a, c = self._views()
        out, values = self._forward(obs.reshape(n * t, self.obs_dim), a, c)
        log_prob, entropy = self._log_prob_entropy(out, actions, a)
        return {"log_prob": log_prob.view(n, t), "values": values.view(n, t), "entropy": entropy.view(n, t)}

    # ------------------------------------------------------------------ rollout API
    def act(self, obs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Sample actions for obs (E, D): ``(actions (E,) or (E, A), log_prob (E,), value (E,))``."""
        a, c = self._views()
        out, values = self._forward(obs, a, c)
        if self.discrete:
            log_p = torch.log_softmax(out, dim=-1)  # (E, K)
            gumbel = torch.empty_like(log_p).exponential_().log_()  # -Gumbel(0, 1) noise
            actions = (log_p - gumbel).argmax(-1, keepdim=True)  # (E, 1), Gumbel-max sample
            return actions.squeeze(-1), log_p.gather(-1, actions).squeeze(-1), values
        log_std = a[-1]
        noise = torch.randn_like(out)
        actions = out + log_std.exp() * noise  # (E, A)
        log_prob = (-0.5 * noise.square() - log_std - 0.5 * LOG_2PI).sum(-1)
        return actions, log_prob, values

    def act_deterministic(self, obs: Tensor) -> Tensor:
        """The mode: argmax of the logits, or the Gaussian mean."""
        a, _ = self._views()
        k = 2 * self.depth
        out = F.linear(self._hidden(obs, a[:k]), a[k], a[k + 1])
        return out.argmax(-1) if self.discrete else out

    def value(self, obs: Tensor) -> Tensor:
        """V(obs) (E,)."""
        a, c = self._views()
        k = 2 * self.depth
        h = self._hidden(obs, a[:k] if self.shared else c[:k])
        return F.linear(h, c[-2], c[-1]).squeeze(-1)

    # ------------------------------------------------------------------ named state
    def named_state(self) -> dict[str, Tensor]:
        """The layers by name (``actor.0.weight``, ..., ``value_head.bias``), for checkpoints."""
        with torch.no_grad():
            a, c = self._views()
            return {name: t.clone() for name, t in zip(self._actor.names + self._critic.names, a + c)}

    def load_named_state(self, state: dict[str, Tensor]) -> None:
        """Inverse of :meth:`named_state`; ValueError on a missing, extra or misshapen tensor."""
        expected = dict(zip(self._actor.names + self._critic.names, self._actor.shapes + self._critic.shapes))
        if set(state) != set(expected):
            missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            raise ValueError(f"network layers differ (missing {missing}, unexpected {extra})")
        for name, shape in expected.items():
            if tuple(state[name].shape) != shape:
                raise ValueError(f"'{name}' has shape {tuple(state[name].shape)}, the config makes {shape}")
        with torch.no_grad():
            for flat, group in ((self.actor_params, self._actor), (self.critic_params, self._critic)):
                if group.names:
                    flat.copy_(torch.cat([state[n].reshape(-1).to(flat.dtype) for n in group.names]))

    # ------------------------------------------------------------------ internals
    def _views(self) -> tuple[list[Tensor], list[Tensor]]:
        if torch.is_grad_enabled():  # training: fresh views, so the gradient flows into the flat parameters
            return self._actor.views(self.actor_params), self._critic.views(self.critic_params)
        # rollouts and evaluation: views of the detached storage, made once; the optimizer's
        # in-place updates show through them (~0.1 ms saved per env step)
        key = (self.actor_params.data_ptr(), self.critic_params.data_ptr())
        if getattr(self, "_cache_key", None) != key:
            self._cache = (self._actor.views(self.actor_params.detach()),
                           self._critic.views(self.critic_params.detach()))
            self._cache_key = key
        return self._cache

    def _hidden(self, x: Tensor, layers: list[Tensor]) -> Tensor:
        for i in range(0, len(layers), 2):
            x = self.act_fn(F.linear(x, layers[i], layers[i + 1]))
        return x

    def _forward(self, obs: Tensor, a: list[Tensor], c: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Policy head output (logits or mean) (N, A) and values (N,)."""
        k = 2 * self.depth
        h = self._hidden(obs, a[:k])
        out = F.linear(h, a[k], a[k + 1])
        hv = h if self.shared else self._hidden(obs, c[:k])
        return out, F.linear(hv, c[-2], c[-1]).squeeze(-1)

    def _log_prob_entropy(self, out: Tensor, actions: Tensor, a: list[Tensor]) -> tuple[Tensor, Tensor]:
        if self.discrete:
            log_p = torch.log_softmax(out, dim=-1)  # (N, K)
            log_prob = log_p.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
            entropy = -(log_p.exp() * log_p).sum(-1)
            return log_prob, entropy
        log_std = a[-1]
        z = (actions - out) * torch.exp(-log_std)  # (N, A)
        log_prob = (-0.5 * z.square() - log_std - 0.5 * LOG_2PI).sum(-1)
        entropy = (0.5 + 0.5 * LOG_2PI + log_std).sum().expand(out.shape[0])
        return log_prob, entropy
