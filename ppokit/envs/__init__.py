"""ppokit.envs: text environments for multi-turn rollouts (games, tools) and users' own.

The API is Gymnasium's on text (:mod:`.base`): ``reset(seed=None) -> (observation, info)``
and ``step(action_text) -> (observation, reward, terminated, truncated, info)``, an
observation being a str or a list of chat messages.

Modules, one job each:

- :mod:`.base`       the API, the documented info keys, :class:`TextEnv`
- :mod:`.checks`     validated reset/step, :func:`step_or_fail` for environments that raise
- :mod:`.registry`   :func:`make_env` by name, ``module:Class``, ``file.py:Class`` or ``textarena:<id>``
- :mod:`.textarena`  TextArena's one- and two-player games (the optional extra ``ppokit[textarena]``)
- :mod:`.tictactoe`, :mod:`.tictactoe_solver`, :mod:`.frozenlake`, :mod:`.guess_number`,
  :mod:`.calculator`  the built-in environments (and exact tic-tac-toe solutions)
- :mod:`.runner`     the reference episode loop with Python policies, evaluation
- :mod:`.sft`        warm-start records from played turns
- :mod:`.selfplay`   seat assignment and the opponent pool
- :mod:`.metrics`    win/draw/loss, illegal actions, turns, returns
"""

from .base import INFO_KEYS, OBSERVATION_MODES, OUTCOMES, TextEnv, TextEnvProtocol
from .checks import (
    EnvError,
    StepResult,
    check_failure_rate,
    check_observation,
    checked_reset,
    checked_step,
    step_or_fail,
)
from .metrics import EpisodeRecord, EpisodeTracker, episode_metrics
from .registry import env_names, load_env_factory, make_env, register_env
from .runner import Episode, Turn, evaluate_policy, expert_policy, play_episode, random_legal_policy
from .selfplay import CURRENT, OpponentPool, assign_seat

__all__ = [
    "CURRENT",
    "INFO_KEYS",
    "OBSERVATION_MODES",
    "OUTCOMES",
    "EnvError",
    "Episode",
    "EpisodeRecord",
    "EpisodeTracker",
    "OpponentPool",
    "StepResult",
    "TextEnv",
    "TextEnvProtocol",
    "Turn",
    "assign_seat",
    "check_failure_rate",
    "check_observation",
    "checked_reset",
    "checked_step",
    "env_names",
    "episode_metrics",
    "evaluate_policy",
    "expert_policy",
    "load_env_factory",
    "make_env",
    "play_episode",
    "random_legal_policy",
    "register_env",
    "step_or_fail",
]
