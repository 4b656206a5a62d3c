"""Self-play on the environment side: which seat the learner plays, and a pool of past opponents.

- :func:`assign_seat`: the seat of the learning policy in episode ``i`` of a rollout,
  alternating or drawn from the seed, so both seats are trained on equally and a
  resumed run reproduces the assignment.
- :class:`OpponentPool`: earlier policy snapshots by id (the caller stores the LoRA
  adapter tensors under those ids) and the rule that picks the opponent of an episode:
  ``"uniform"`` over the pool, or ``"latest"``-biased (the newest snapshot with
  probability ``latest_prob``, else uniform over the older ones). With
  ``current_prob`` > 0 a draw returns :data:`CURRENT` (play the live policy: pure
  self-play) with that probability. It records the learner's results against each
  snapshot. ``state_dict()`` is plain data (JSON-serialisable), RNG state included.
"""

from __future__ import annotations

import random
from typing import Any

from ppokit.errors import UserError

from .base import OUTCOMES

__all__ = ["CURRENT", "OpponentPool", "SEAT_MODES", "assign_seat"]

SEAT_MODES = ("alternate", "random")
CURRENT = "current"  # the id :meth:`OpponentPool.sample` returns for "play the live policy"
SAMPLING = ("uniform", "latest")


def assign_seat(episode: int, *, mode: str | int = "alternate", seed: int = 0, num_seats: int = 2) -> int:
    """The learner's seat in episode ``episode`` (0-based count over the run).

    ``"alternate"``: ``(episode + seed) % num_seats``; ``"random"``: uniform, a pure
    function of ``(seed, episode)``; an int: that seat every time.
    """
    if isinstance(mode, int) and not isinstance(mode, bool):
        if not 0 <= mode < num_seats:
            raise UserError(f"seat {mode} does not exist; seats are 0..{num_seats - 1}")
        return mode
    if mode == "alternate":
        return (episode + seed) % num_seats
    if mode == "random":
        return random.Random(f"{seed}:{episode}").randrange(num_seats)
    raise UserError(f"seat mode must be one of {', '.join(SEAT_MODES)} or a seat number (got {mode!r})")


class OpponentPool:
    """Past policy snapshots to play against; see the module docstring.

    ``capacity``: keep at most this many snapshots (the oldest unpinned one is dropped
    first; ``None``: no limit). ``pinned=True`` in :meth:`add` keeps a snapshot (say, the
    starting policy) forever.
    """

    def __init__(
        self,
        *,
        sampling: str = "uniform",
        latest_prob: float = 0.5,
        current_prob: float = 0.0,
        capacity: int | None = None,
        seed: int = 0,
    ) -> None:
        if sampling not in SAMPLING:
            raise UserError(f"opponent sampling must be one of {', '.join(SAMPLING)} (got {sampling!r})")
        for name, p in (("latest_prob", latest_prob), ("current_prob", current_prob)):
            if not 0.0 <= p <= 1.0:
                raise UserError(f"opponent pool: {name} must be in [0, 1] (got {p})")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise UserError(f"opponent pool: capacity must be a positive int or None (got {capacity!r})")
        self.sampling, self.latest_prob, self.current_prob = sampling, float(latest_prob), float(current_prob)
        self.capacity = capacity
        self._rng = random.Random(seed)
        self._snapshots: list[dict[str, Any]] = []  # oldest first: {"id", "pinned", "meta"}
        self._results: dict[str, dict[str, int]] = {}

    # ------------------------------------------------------------------ contents
    def __len__(self) -> int:
        return len(self._snapshots)

    def __contains__(self, snapshot_id: object) -> bool:
        return any(s["id"] == snapshot_id for s in self._snapshots)

    def ids(self) -> list[str]:
        """Snapshot ids, oldest first."""
        return [s["id"] for s in self._snapshots]

    def meta(self, snapshot_id: str) -> dict[str, Any]:
        """The plain data given with the snapshot in :meth:`add`."""
        for s in self._snapshots:
            if s["id"] == snapshot_id:
                return s["meta"]
        raise KeyError(snapshot_id)

    def add(self, snapshot_id: str, *, pinned: bool = False, **meta: Any) -> list[str]:
        """Add a snapshot (newest); returns the ids dropped to respect ``capacity`` (the
        caller deletes their weights)."""
        if not isinstance(snapshot_id, str) or not snapshot_id or snapshot_id == CURRENT:
            raise ValueError(f"snapshot ids must be non-empty strings other than {CURRENT!r}, got {snapshot_id!r}")
        if snapshot_id in self:
            raise ValueError(f"snapshot {snapshot_id!r} is already in the pool")
        self._snapshots.append({"id": snapshot_id, "pinned": bool(pinned), "meta": dict(meta)})
        dropped: list[str] = []
        while self.capacity is not None and len(self._snapshots) > self.capacity:
            victim = next((s for s in self._snapshots if not s["pinned"]), None)
            if victim is None:
                break
            self._snapshots.remove(victim)
            dropped.append(victim["id"])
        return dropped

    def remove(self, snapshot_id: str) -> None:
        before = len(self._snapshots)
        self._snapshots = [s for s in self._snapshots if s["id"] != snapshot_id]
        if len(self._snapshots) == before:
            raise KeyError(snapshot_id)

    # ------------------------------------------------------------------ sampling
    def sample(self) -> str:
        """The opponent of one episode: a snapshot id, or :data:`CURRENT`."""
        if self.current_prob > 0 and self._rng.random() < self.current_prob:
            return CURRENT
        if not self._snapshots:
            if self.current_prob > 0:
                return CURRENT
            raise ValueError("the opponent pool is empty; add a snapshot first (or set current_prob > 0)")
        ids = self.ids()
        if self.sampling == "latest" and len(ids) > 1:
            if self._rng.random() < self.latest_prob:
                return ids[-1]
            return self._rng.choice(ids[:-1])
        return self._rng.choice(ids)

    def probabilities(self) -> dict[str, float]:
        """The probability :meth:`sample` returns each id (and :data:`CURRENT`)."""
        ids = self.ids()
        rest = 1.0 - self.current_prob if ids else 0.0
        probs = {CURRENT: 1.0 - rest} if self.current_prob > 0 or not ids else {}
        if self.sampling == "latest" and len(ids) > 1:
            probs.update({i: rest * (1 - self.latest_prob) / (len(ids) - 1) for i in ids[:-1]})
            probs[ids[-1]] = rest * self.latest_prob
        else:
            probs.update({i: rest / len(ids) for i in ids})
        return probs

    # ------------------------------------------------------------------ results
    def record(self, snapshot_id: str, outcome: str) -> None:
        """The learner's outcome (win / draw / loss) in a game against ``snapshot_id``."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
        counts = self._results.setdefault(snapshot_id, dict.fromkeys(OUTCOMES, 0))
        counts[outcome] += 1

    def results(self) -> dict[str, dict[str, int]]:
        """``{id: {"win": n, "draw": n, "loss": n}}`` for every opponent played."""
        return {k: dict(v) for k, v in self._results.items()}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        return {
            "sampling": self.sampling,
            "latest_prob": self.latest_prob,
            "current_prob": self.current_prob,
            "capacity": self.capacity,
            "snapshots": [{"id": s["id"], "pinned": s["pinned"], "meta": dict(s["meta"])} for s in self._snapshots],
            "results": self.results(),
            "rng_state": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            sampling, capacity = state["sampling"], state["capacity"]
            latest_prob, current_prob = float(state["latest_prob"]), float(state["current_prob"])
            snapshots = [
                {"id": str(s["id"]), "pinned": bool(s["pinned"]), "meta": dict(s["meta"])} for s in state["snapshots"]
            ]
            results = {str(k): {o: int(v[o]) for o in OUTCOMES} for k, v in state["results"].items()}
            version, internal, gauss = state["rng_state"]
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(
                f"opponent pool state is incomplete or malformed ({type(exc).__name__}: {exc}); "
                "it must come from OpponentPool.state_dict()"
            ) from None
        self.__init__(sampling=sampling, latest_prob=latest_prob, current_prob=current_prob, capacity=capacity)
        self._snapshots, self._results = snapshots, results
        self._rng.setstate((version, tuple(internal), gauss))
