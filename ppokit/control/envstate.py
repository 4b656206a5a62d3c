"""Snapshots of Gymnasium vector environments, for exact resume.

A run stops at an iteration boundary with its environments in the middle of episodes;
resuming must continue those episodes exactly. There is no Gymnasium API for that, so
:func:`snapshot` walks the objects a vector env is made of and keeps their plain data:

- the vector env itself (Gymnasium's native CartPole vector env keeps ``state``,
  ``steps``, ``prev_done`` and its ``np_random`` there; ``SyncVectorEnv`` its autoreset
  flags and buffers), its vector wrappers (``.env``) and, for ``SyncVectorEnv``, each
  sub-env's wrapper chain down to the unwrapped env (``TimeLimit._elapsed_steps``,
  ``OrderEnforcing._has_reset``, the physics ``state`` array of a classic-control env, ...);
- of each object, the attributes that are plain data: numbers, bools, strings, None,
  numpy arrays of numbers/bools, numpy scalars, lists of those, and
  ``np.random.Generator`` states. Everything else (spaces, specs, renderers, dicts) is
  configuration the freshly made env already has;
- for MuJoCo envs, ``mujoco.mj_getState(model, data, mjSTATE_INTEGRATION)`` (time,
  qpos, qvel, act, warm start, controls, applied forces, mocap): ``mj_setState`` restores
  it and the next ``mj_step`` recomputes everything derived from it.

:func:`restore` sets the attributes back on an env built from the same config; a chain
of different classes is an error. ``AsyncVectorEnv`` keeps its envs in subprocesses:
:func:`snapshot` raises :class:`NotSnapshottable` and the workload restarts its episodes
instead (a resumed async run is not bit-identical; it says so once).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from ppokit.persistence.resume import generator_state, set_generator_state

_NUMERIC_KINDS = "biuf"  # bool, int, uint, float
_MAX_ARRAY = 1 << 22  # larger arrays are caches, not state (e.g. rendered frames)


class NotSnapshottable(Exception):
    """This vector env's state cannot be captured in-process."""


def _plain(value: Any) -> tuple[bool, Any]:
    """(is plain data, checkpoint-storable form)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True, value
    if isinstance(value, np.ndarray):
        if value.dtype.kind in _NUMERIC_KINDS and value.dtype.itemsize <= 8 and value.size <= _MAX_ARRAY:
            if value.dtype.kind == "u" and value.dtype.itemsize > 1:  # safetensors/torch: no wide unsigned
                return True, {"__uarray__": value.astype(np.int64), "dtype": value.dtype.str}
            return True, {"__array__": value.copy()}
        return False, None
    if isinstance(value, np.generic) and value.dtype.kind in _NUMERIC_KINDS:
        return True, {"__scalar__": np.array(value), "dtype": value.dtype.str}
    if isinstance(value, np.random.Generator):
        return True, {"__np_generator__": generator_state(value)}
    if isinstance(value, list):
        items = [_plain(v) for v in value]
        if all(ok for ok, _ in items):
            return True, {"__list__": [v for _, v in items]}
    return False, None


def _value(stored: Any, current: Any) -> Any:
    """Rebuild a stored attribute (``current``: the fresh env's value, reused for generators)."""
    if isinstance(stored, dict):
        if "__array__" in stored:
            return np.array(stored["__array__"], copy=True)
        if "__uarray__" in stored:
            return np.asarray(stored["__uarray__"]).astype(np.dtype(stored["dtype"]))
        if "__scalar__" in stored:
            return np.asarray(stored["__scalar__"]).astype(np.dtype(stored["dtype"]))[()]
        if "__np_generator__" in stored:
            state = stored["__np_generator__"]
            gen = (
                current
                if isinstance(current, np.random.Generator)
                else np.random.Generator(getattr(np.random, state["bit_generator"])())
            )
            set_generator_state(gen, state)
            return gen
        if "__list__" in stored:
            cur = (
                current
                if isinstance(current, list) and len(current) == len(stored["__list__"])
                else [None] * len(stored["__list__"])
            )
            return [_value(v, c) for v, c in zip(stored["__list__"], cur)]
    if isinstance(stored, np.ndarray):  # a checkpoint brings 0-d arrays back as arrays
        return stored
    return stored


def _object_state(obj: Any) -> dict[str, Any]:
    attrs = {}
    for name, value in vars(obj).items():
        ok, stored = _plain(value)
        if ok:
            attrs[name] = stored
    state: dict[str, Any] = {"class": type(obj).__name__, "attrs": attrs}
    data, model = getattr(obj, "data", None), getattr(obj, "model", None)
    if type(data).__module__.startswith("mujoco") and type(model).__module__.startswith("mujoco"):
        import mujoco

        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        buf = np.empty(mujoco.mj_stateSize(model, spec), np.float64)
        mujoco.mj_getState(model, data, buf, spec)
        state["mujoco"] = buf
    return state


def _restore_object(obj: Any, state: dict[str, Any], where: str) -> None:
    if state.get("class") != type(obj).__name__:
        raise ValueError(f"{where}: the checkpoint holds a {state.get('class')}, the env is a {type(obj).__name__}")
    for name, stored in state["attrs"].items():
        setattr(obj, name, _value(stored, getattr(obj, name, None)))
    if "mujoco" in state:
        import mujoco

        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        buf = np.ascontiguousarray(np.asarray(state["mujoco"], np.float64))
        if buf.size != mujoco.mj_stateSize(obj.model, spec):
            raise ValueError(
                f"{where}: MuJoCo state of size {buf.size}, expected {mujoco.mj_stateSize(obj.model, spec)}"
            )
        mujoco.mj_setState(obj.model, obj.data, buf, spec)
        mujoco.mj_forward(obj.model, obj.data)


def _chain(env: Any) -> list[Any]:
    """``env``, ``env.env``, ... down to the object without an ``env`` attribute."""
    out = [env]
    while "env" in vars(out[-1]):
        out.append(vars(out[-1])["env"])
    return out


def snapshot(venv: Any) -> dict[str, Any]:
    """The plain-data state of a Gymnasium vector env (see the module docstring)."""
    layers = _chain(venv)
    if any(isinstance(layer, gym.vector.AsyncVectorEnv) for layer in layers):
        raise NotSnapshottable("AsyncVectorEnv keeps its environments in subprocesses")
    state: dict[str, Any] = {"layers": [_object_state(layer) for layer in layers]}
    inner = layers[-1]
    if isinstance(inner, gym.vector.SyncVectorEnv):
        state["envs"] = [[_object_state(layer) for layer in _chain(env)] for env in inner.envs]
    return state


def restore(venv: Any, state: dict[str, Any]) -> None:
    """Put a :func:`snapshot` back into ``venv`` (built from the same config); ValueError on mismatch."""
    layers = _chain(venv)
    if len(layers) != len(state["layers"]):
        raise ValueError(f"the checkpoint's vector env has {len(state['layers'])} layers, this one {len(layers)}")
    for i, (layer, st) in enumerate(zip(layers, state["layers"])):
        _restore_object(layer, st, f"vector env layer {i}")
    if "envs" in state:
        envs = getattr(layers[-1], "envs", None)
        if envs is None or len(envs) != len(state["envs"]):
            raise ValueError("the checkpoint's vector env has a different number of environments")
        for i, (env, chain_state) in enumerate(zip(envs, state["envs"])):
            chain = _chain(env)
            if len(chain) != len(chain_state):
                raise ValueError(
                    f"env {i}: the checkpoint's wrapper chain has {len(chain_state)} layers, this one {len(chain)}"
                )
            for j, (layer, st) in enumerate(zip(chain, chain_state)):
                _restore_object(layer, st, f"env {i} layer {j}")
