"""Gymnasium ids to vector environments, without torch: the registered spec, the vectorization
mode, ``gym.make_vec`` with NEXT_STEP autoreset and the checks a run's environments must pass.

``env.vectorization: auto`` picks Gymnasium's native vector env (one numpy step for all envs, e.g.
CartPole) when the id has one that loads and autoresets NEXT_STEP, else ``sync`` (``async`` pays a
pipe round trip per step: more than a classic-control or MuJoCo step costs on a small machine).
:func:`check_env_run` is what the workload registry (:data:`ppokit.workloads.WORKLOADS`) asks
before it imports the control workload (torch): a mistyped ``env.id`` is one line at once.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import gymnasium as gym

from ppokit.config import Config, EnvConfig
from ppokit.errors import UserError, did_you_mean, first_line


def resolve_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """The registered spec of ``env_id``; an unknown id is a :class:`UserError` with a hint."""
    find = getattr(gym.envs.registration, "_find_spec", gym.spec)  # _find_spec: what make_vec uses;
    try:  # it imports 'module:' prefixes
        with warnings.catch_warnings(record=True) as said:  # (an out-of-date version warns, then fails)
            warnings.simplefilter("always")
            spec = find(env_id)
        for w in said:  # found: its warnings are shown as usual
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return spec
    except gym.error.Error as exc:  # NameNotFound, VersionNotFound, DeprecatedEnv, NamespaceNotFound, ...
        hint = did_you_mean(env_id.split(":")[-1], list(gym.registry.keys()))
        reason = "" if hint else f" ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        raise UserError(f"env.id: unknown Gymnasium environment '{env_id}'{hint}{reason}") from None
    except ModuleNotFoundError as exc:  # 'module:Env-v0' whose module does not import
        reason = str(exc).split(". ")[0]
        raise UserError(f"env.id: cannot import the module of '{env_id}' ({reason})") from None


def _native_vector_ok(spec: gym.envs.registration.EnvSpec) -> bool:
    """True when the id has a native vector env that loads and autoresets NEXT_STEP."""
    entry = spec.vector_entry_point
    if entry is None or spec.additional_wrappers:
        return False
    try:
        creator = entry if callable(entry) else gym.envs.registration.load_env_creator(entry)
    except Exception:  # e.g. the Jax envs without jax installed
        return False
    mode = getattr(creator, "metadata", {}).get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
    return mode == gym.vector.AutoresetMode.NEXT_STEP


def vectorization_mode(env_cfg: EnvConfig) -> str:
    """The ``make_vec`` mode that ``env.vectorization`` resolves to for this id."""
    spec = resolve_spec(env_cfg.id)
    if env_cfg.vectorization == "auto":
        return "vector_entry_point" if _native_vector_ok(spec) else "sync"
    if env_cfg.vectorization == "vector_entry_point" and not _native_vector_ok(spec):
        raise UserError(
            f"env.vectorization=vector_entry_point: '{env_cfg.id}' has no native vector env with "
            "NEXT_STEP autoreset; use auto or sync"
        )
    return env_cfg.vectorization


def make_vector_env(env_cfg: EnvConfig, num_envs: int) -> gym.vector.VectorEnv:
    """``gym.make_vec`` with the resolved mode and NEXT_STEP autoreset; checks the spaces."""
    mode = vectorization_mode(env_cfg)
    kwargs: dict[str, Any] = dict(env_cfg.kwargs)
    if env_cfg.max_episode_steps is not None:
        kwargs["max_episode_steps"] = env_cfg.max_episode_steps
    vector_kwargs: dict[str, Any] = {}
    if mode in ("sync", "async"):
        vector_kwargs["autoreset_mode"] = gym.vector.AutoresetMode.NEXT_STEP
        if mode == "sync":
            vector_kwargs["copy"] = False  # VecEnv copies what it keeps; no deepcopy per step
    # async: each worker process leaves the terminal's process group once its env is made
    wrappers = [functools.partial(_in_own_session, maker=os.getpid())] if mode == "async" else None
    try:
        venv = gym.make_vec(
            env_cfg.id,
            num_envs=num_envs,
            vectorization_mode=mode,
            vector_kwargs=vector_kwargs,
            wrappers=wrappers,
            **kwargs,
        )
    except gym.error.DependencyNotInstalled as exc:
        raise UserError(f"env.id={env_cfg.id}: {str(exc).splitlines()[0]}") from None
    except TypeError as exc:
        raise UserError(f"env.kwargs: {env_cfg.id} does not accept these arguments ({exc})") from None
    try:
        check_spaces(env_cfg.id, venv.single_observation_space, venv.single_action_space)
        autoreset = venv.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
        if autoreset != gym.vector.AutoresetMode.NEXT_STEP:
            raise UserError(
                f"env.id={env_cfg.id}: vector env autoresets with {autoreset}; "
                "ppokit needs NEXT_STEP (use env.vectorization=sync)"
            )
    except UserError:
        venv.close()
        raise
    return venv


def _in_own_session(env: gym.Env, maker: int) -> gym.Env:
    """Run after each env of an async vector env is made (``make_vec``'s ``wrappers``): in a worker
    process (not ``maker``, which makes one env too, for the spaces) the process starts a session of
    its own, so that Ctrl-C in a terminal (SIGINT to the whole foreground process group; ``timeout``
    sends SIGTERM the same way) reaches the training process alone, which steps the envs to the end
    of the iteration, saves a checkpoint and closes them (:class:`ppokit.persistence.resume.GracefulStop`), where
    the workers would die mid-step. ``env`` unchanged."""
    if os.getpid() != maker:
        os.setsid()
    return env


def check_environment(env_cfg: EnvConfig) -> None:
    """What a run's environments would fail on, before a run directory exists: the id, the
    arguments ``gymnasium.make`` takes, the spaces (:func:`make_vector_env`); with ``env.kwargs``
    also one reset and one random step, where an argument of the wrong kind fails inside the
    environment's own code (Pendulum's ``g: abc`` at its first step)."""
    venv = make_vector_env(env_cfg, 1)
    try:
        if env_cfg.kwargs:
            venv.reset(seed=0)
            venv.step(venv.action_space.sample())
    except Exception as exc:  # noqa: BLE001 - any failure of the environment's code
        raise UserError(
            f"env.kwargs: {env_cfg.id} fails with these arguments at its first reset and step "
            f"({type(exc).__name__}: {first_line(exc)})"
        ) from None
    finally:
        venv.close()


def check_spaces(env_id: str, obs_space: gym.Space, act_space: gym.Space) -> None:
    """Flat Box observations; Discrete or 1-D Box actions. Anything else: one-line UserError."""
    if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
        raise UserError(
            f"env.id={env_id}: observation space {obs_space} is not supported; the MLP policy needs "
            "a flat Box (wrap the env with gymnasium.wrappers.FlattenObservation)"
        )
    if isinstance(act_space, gym.spaces.Discrete):
        return
    if isinstance(act_space, gym.spaces.Box) and len(act_space.shape) == 1:
        return
    raise UserError(
        f"env.id={env_id}: action space {type(act_space).__name__}{_shape(act_space)} is not supported; "
        "ppokit handles Discrete (categorical policy) and 1-D Box (Gaussian policy)"
    )


def _shape(space: gym.Space) -> str:
    shape = getattr(space, "shape", None)
    return f"{tuple(shape)}" if shape else ""


def check_env_run(cfg: Config) -> dict[str, Any]:
    """A control run's ``env.id`` and ``env.vectorization`` resolved, before torch is imported (the
    environment itself is made by the workload's own check); nothing is handed on."""
    vectorization_mode(cfg.env)
    return {}
