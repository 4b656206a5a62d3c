"""KL divergence between the policy and a reference policy, and KL-coefficient controllers.

Per-token estimators of ``KL(pi || pi_ref)`` from the log-probs of the *sampled*
tokens (``lp = log pi(a_t)``, ``ref = log pi_ref(a_t)``, ``a_t ~ pi``); see
J. Schulman, "Approximating KL Divergence" (2020)::

    kl  / k1        lp - ref                              unbiased, high variance, can be < 0
    abs             |lp - ref|
    mse / k2        0.5 (lp - ref)^2                      >= 0, biased
    low_var_kl / k3 exp(d) - d - 1, d = ref - lp          >= 0, unbiased, low variance

:func:`kl_full` is the exact KL over the vocabulary, from the full logits
(:func:`~ppokit.algo.kl_hidden.kl_full_from_hidden` the same from hidden states,
chunked). :func:`mean_sequence_kl` reduces a per-token KL to the number the
adaptive in-reward controller reads.

Coefficient controllers: :class:`FixedKLController` and :class:`AdaptiveKLController`
(the in-reward KL coefficient, Ziegler et al. 2019), :class:`AdaptivePenaltyCoef`
(the PPO paper's adaptive KL-penalty coefficient for the ``penalty`` policy loss).
"""

from __future__ import annotations

import difflib
import math
import numbers

import torch

from .registry import Registry, UnknownNameError

__all__ = [
    "AdaptiveKLController",
    "AdaptivePenaltyCoef",
    "FixedKLController",
    "KL_ESTIMATORS",
    "kl_full",
    "kl_penalty",
    "make_kl_controller",
    "mean_sequence_kl",
]

KL_ESTIMATORS: Registry = Registry("KL estimator")

K3_LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


@KL_ESTIMATORS.register("kl", "k1")
def _k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``lp - ref``."""
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("abs")
def _abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``|lp - ref|``."""
    return (log_prob - ref_log_prob).abs()


@KL_ESTIMATORS.register("mse", "k2")
def _k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``0.5 (lp - ref)^2``."""
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("low_var_kl", "k3")
def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``clamp(exp(d) - d - 1, -10, 10)`` with ``d = clamp(ref - lp, -20, 20)``."""
    d = (ref_log_prob - log_prob).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.expm1(d) - d).clamp(-K3_CLAMP, K3_CLAMP)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the ``kind`` named in :data:`KL_ESTIMATORS` (same shape as the inputs).

    ``kind="full"`` is not a per-token estimator: use :func:`kl_full` with logits.
    """
    if kind == "full":
        raise ValueError("KL estimator 'full' needs the full distributions: call kl_full(logits, ref_logits)")
    fn = KL_ESTIMATORS.get(kind)
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(f"log_prob shape {tuple(log_prob.shape)} != ref_log_prob shape {tuple(ref_log_prob.shape)}")
    return fn(log_prob, ref_log_prob)


def kl_full(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact ``KL(p || p_ref) = sum_v p_v (log p_v - log p_ref_v)`` over the last dim.

    ``p = softmax(logits)``, ``p_ref = softmax(ref_logits)``; (..., V) -> (...),
    e.g. (B, T, V) -> (B, T). Computed with ``log_softmax`` in at least float32
    (bf16/fp16 inputs give a float32 result). Terms with ``p_v = 0`` are 0.
    Materialises a few (..., V) temporaries: chunk the rows for huge vocabularies.
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} != ref_logits shape {tuple(ref_logits.shape)}")
    dtype = torch.promote_types(torch.promote_types(logits.dtype, ref_logits.dtype), torch.float32)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)  # (..., V)
    logq = torch.log_softmax(ref_logits.to(dtype), dim=-1)  # (..., V)
    p = logp.exp()
    terms = torch.where(p > 0, p * (logp - logq), torch.zeros((), dtype=dtype, device=p.device))
    return terms.sum(-1)


def mean_sequence_kl(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean over sequences of each sequence's mean per-token KL (0-dim).

    ``kl`` (B, T) per-token KL estimates, ``mask`` (B, T) bool or 0/1::

        kl_b = sum_t m_bt kl_bt / sum_t m_bt         for rows with sum_t m_bt > 0
        out  = mean_b kl_b  over those rows           (0 if there is none)

    This is the ``current_kl`` that verl's ``apply_kl_penalty`` feeds to its adaptive
    KL controller (every sequence weighs the same, whatever its length). verl
    averages over all rows, counting a row without valid tokens as 0; here such rows
    are left out (they carry no KL measurement). Padding may hold NaN/inf. No host sync.
    """
    if kl.dim() != 2:
        raise ValueError(f"kl must be 2-D (B, T), got shape {tuple(kl.shape)}")
    if mask.shape != kl.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != kl shape {tuple(kl.shape)}")
    m = mask if mask.dtype == torch.bool else mask != 0  # (B, T)
    dtype = kl.dtype if kl.dtype.is_floating_point else torch.float32
    zero = torch.zeros((), dtype=dtype, device=kl.device)
    n_tok = m.sum(-1)  # (B,)
    row_mean = torch.where(m, kl.to(dtype), zero).sum(-1) / n_tok.clamp(min=1).to(dtype)  # (B,)
    has = n_tok > 0  # (B,)
    return torch.where(has, row_mean, zero).sum() / has.sum().clamp(min=1).to(dtype)


# ----------------------------------------------------------------------------- controllers


def _positive(name: str, v: object) -> float:
    if isinstance(v, torch.Tensor):
        v = v.item()
    if not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    return float(v)


class FixedKLController:
    """A constant KL coefficient: ``.value`` never changes."""

    def __init__(self, kl_coef: float):
        if isinstance(kl_coef, torch.Tensor):
            kl_coef = kl_coef.item()
        if not isinstance(kl_coef, numbers.Real) or not math.isfinite(kl_coef) or kl_coef < 0:
            raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef!r}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"FixedKLController(value={self.value})"


class AdaptiveKLController:
    """The adaptive KL coefficient of Ziegler et al. (2019) / InstructGPT.

    ``update(current_kl, n_steps)``::

        e      = clip(current_kl / target_kl - 1, -0.2, 0.2)
        value *= 1 + e * n_steps / horizon

    so the coefficient grows when the measured KL is above target and shrinks below.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        self.value = _positive("init_kl_coef", init_kl_coef)
        self.target_kl = _positive("target_kl", target_kl)
        self.horizon = _positive("horizon", horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Apply the proportional rule above; ``current_kl`` may be a 0-dim tensor (read once)."""
        if isinstance(current_kl, torch.Tensor):
            current_kl = current_kl.item()
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """Plain floats (JSON-serialisable); only ``value`` is state, the rest is config."""
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore ``value``; ``target_kl`` / ``horizon`` stay as constructed (config wins)."""
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target_kl={self.target_kl}, horizon={self.horizon})"


_CONTROLLER_TYPES = ("fixed", "adaptive")


def make_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build a KL controller: ``"fixed"`` (``kl_coef``) or ``"adaptive"``
    (``kl_coef`` is the initial value; needs ``target_kl`` and ``horizon``).

    Unknown types raise :class:`UnknownNameError` (a ValueError) with a hint;
    missing or non-positive adaptive settings raise ValueError.
    """
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        missing = [n for n, v in (("target_kl", target_kl), ("horizon", horizon)) if v is None]
        if missing:
            raise ValueError(f"adaptive KL controller needs {' and '.join(missing)}")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    close = difflib.get_close_matches(type, _CONTROLLER_TYPES, n=1) if isinstance(type, str) else []
    raise UnknownNameError(
        "KL controller type", type, close[0] if close else None, _CONTROLLER_TYPES, ", ".join(_CONTROLLER_TYPES)
    )


class AdaptivePenaltyCoef:
    """The adaptive KL-penalty coefficient ``beta`` of the PPO paper (Schulman et al., 2017, sec. 4).

    After each iteration's policy update, with ``d`` the measured
    ``KL(pi_old || pi)`` (e.g. the mean of the ``penalty`` loss's ``kl_old``)::

        d > 1.5 * target_kl   ->  beta *= 2
        d < target_kl / 1.5   ->  beta /= 2
        otherwise             ->  beta unchanged

    The paper notes the result is insensitive to 1.5 and 2 and to the initial
    ``beta``, which adapts quickly. ``value`` is the coefficient to pass as the
    loss's ``penalty_coef`` in the next iteration.
    """

    def __init__(self, init_coef: float, target_kl: float):
        self.value = _positive("init_coef", init_coef)
        self.target_kl = _positive("target_kl", target_kl)

    def update(self, measured_kl: float) -> float:
        """Apply the rule above and return the new ``value``; ``measured_kl`` may be a 0-dim tensor (read once)."""
        if isinstance(measured_kl, torch.Tensor):
            measured_kl = measured_kl.item()
        if isinstance(measured_kl, bool) or not isinstance(measured_kl, numbers.Real):
            raise ValueError(f"measured_kl must be a number, got {measured_kl!r}")
        measured_kl = float(measured_kl)
        if not math.isfinite(measured_kl):
            raise ValueError(f"measured_kl must be finite, got {measured_kl}")
        if measured_kl > 1.5 * self.target_kl:
            self.value *= 2.0
        elif measured_kl < self.target_kl / 1.5:
            self.value /= 2.0
        return self.value

    def state_dict(self) -> dict[str, float]:
        """Plain floats (JSON-serialisable); only ``value`` is state, ``target_kl`` is config."""
        return {"value": self.value, "target_kl": self.target_kl}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore ``value``; ``target_kl`` stays as constructed (config wins)."""
        self.value = _positive("value", state["value"])

    def __repr__(self) -> str:
        return f"AdaptivePenaltyCoef(value={self.value}, target_kl={self.target_kl})"
