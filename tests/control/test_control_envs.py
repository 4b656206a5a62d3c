"""Vector env creation, NEXT_STEP autoreset flags, normalization statistics."""

from __future__ import annotations

import numpy as np
import pytest

from ppokit.control.envs import Normalizer, RunningMeanStd, VecEnv
from ppokit.control.vector_env import make_vector_env, resolve_spec, vectorization_mode
from ppokit.errors import UserError


def test_unknown_env_id_suggests_a_registered_one(make_cfg):
    with pytest.raises(UserError, match=r"unknown Gymnasium environment 'CartPol-v1'; did you mean 'CartPole-v1'\?"):
        resolve_spec("CartPol-v1")
    with pytest.raises(UserError, match="cannot import the module"):
        resolve_spec("no_such_module_xyz:Foo-v0")


def test_an_out_of_date_version_is_one_error_without_gymnasiums_warning(recwarn):
    """Gymnasium warns that Taxi-v3 is out of date, then refuses it: only ppokit's line is said."""
    with pytest.raises(UserError, match=r"'Taxi-v3'; did you mean 'Taxi-v4'\?"):
        resolve_spec("Taxi-v3")
    assert not [w for w in recwarn if "out of date" in str(w.message)]
    assert resolve_spec("CartPole-v1").id == "CartPole-v1"


@pytest.mark.parametrize(
    "env_id, what",
    [
        ("ppokit-test/MultiBinary-v0", "action space MultiBinary"),
        ("ppokit-test/DictObs-v0", "observation space"),
        ("Blackjack-v1", "observation space"),
    ],
)
def test_unsupported_spaces_are_user_errors(make_cfg, env_id, what):
    cfg = make_cfg(f"env.id={env_id}")
    with pytest.raises(UserError, match=what) as info:
        make_vector_env(cfg.env, 2)
    assert "\n" not in str(info.value)


def test_auto_vectorization_uses_the_native_vector_env_where_there_is_one(make_cfg):
    assert vectorization_mode(make_cfg("env.id=CartPole-v1").env) == "vector_entry_point"
    assert vectorization_mode(make_cfg("env.id=Pendulum-v1").env) == "sync"
    with pytest.raises(UserError, match="no native vector env"):
        vectorization_mode(make_cfg("env.id=Pendulum-v1", "env.vectorization=vector_entry_point").env)


@pytest.mark.parametrize("mode", ["vector_entry_point", "sync"])
def test_next_step_reset_steps_are_flagged(make_cfg, mode):
    # CartPole truncated at 5 steps: done at step index 4, the reset step is index 5.
    cfg = make_cfg("env.id=CartPole-v1", "env.max_episode_steps=5", f"env.vectorization={mode}")
    venv = VecEnv(cfg.env, 3, seed=0, gamma=0.99)
    obs = venv.reset()
    assert obs.shape == (3, 4) and obs.dtype == np.float32
    flags = []
    for _ in range(12):
        obs, raw, _, term, trunc, reset_step = venv.step(np.zeros(3, np.int64))
        flags.append((bool((term | trunc).all()), bool(reset_step.all()), float(raw[0])))
        assert (reset_step == reset_step[0]).all()
    done = [f[0] for f in flags]
    reset = [f[1] for f in flags]
    # constant action 0 may terminate earlier than 5 steps; after every done comes exactly one reset step
    for t in range(1, len(flags)):
        assert reset[t] == done[t - 1]
        if reset[t]:
            assert flags[t][2] == 0.0 and not done[t]
    assert venv.episodes_finished == 3 * sum(done)
    assert all(1 <= n <= 5 for n in venv.episode_lengths)
    venv.close()


def test_box_actions_are_clipped_only_when_stepping(make_cfg):
    cfg = make_cfg("env.id=ppokit-test/Countdown-v0")
    venv = VecEnv(cfg.env, 2, seed=0, gamma=0.99)
    venv.reset()
    actions = np.array([[5.0], [-5.0]], np.float32)
    _, raw, *_ = venv.step(actions)
    assert raw.tolist() == [2.0, -2.0]  # reward = the (clipped) action
    assert actions.tolist() == [[5.0], [-5.0]]  # the caller's array (the trained sample) is untouched
    venv.close()


def test_running_mean_std_merges_batches_exactly():
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, size=(1000, 3))
    rms = RunningMeanStd((3,))
    for chunk in np.array_split(data, 17):
        rms.update(chunk)
    np.testing.assert_allclose(rms.mean, data.mean(0), rtol=1e-6)
    np.testing.assert_allclose(rms.var, data.var(0), rtol=1e-4)


def test_reward_normalization_follows_vecnormalize(make_cfg):
    cfg = make_cfg("env.normalize_reward=true", "env.clip_reward=5")
    norm = Normalizer(cfg.env, obs_dim=1, num_envs=2, gamma=0.9)
    rng = np.random.default_rng(1)
    ret = np.zeros(2)
    ref = RunningMeanStd(())
    for _t in range(50):
        reward = rng.normal(size=2) * 10
        done = rng.random(2) < 0.1
        valid = np.ones(2, bool)
        out = norm.reward(reward, done, valid)
        # SB3 VecNormalize: ret = ret * gamma + r; update; r / sqrt(var + eps), clip; ret[done] = 0
        ret = ret * 0.9 + reward
        ref.update(ret)
        expected = np.clip(reward / np.sqrt(ref.var + 1e-8), -5, 5)
        ret[done] = 0
        np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_reset_steps_do_not_update_reward_statistics(make_cfg):
    cfg = make_cfg("env.normalize_reward=true")
    norm = Normalizer(cfg.env, obs_dim=1, num_envs=2, gamma=0.9)
    norm.reward(np.array([1.0, 2.0]), np.array([False, True]), np.array([True, True]))
    count = norm.ret_rms.count
    norm.reward(np.array([0.0, 0.0]), np.array([False, False]), np.array([False, False]))
    assert norm.ret_rms.count == count


def test_observation_normalization_and_frozen_stats(make_cfg):
    cfg = make_cfg("env.normalize_obs=true", "env.clip_obs=3")
    norm = Normalizer(cfg.env, obs_dim=2, num_envs=4, gamma=0.99)
    rng = np.random.default_rng(2)
    for _ in range(200):
        norm.obs(rng.normal([5.0, -1.0], [2.0, 0.5], size=(4, 2)))
    np.testing.assert_allclose(norm.obs_rms.mean, [5.0, -1.0], atol=0.2)
    out = norm.obs(np.array([[5.0, -1.0], [1e6, -1e6]]))
    assert out.dtype == np.float32 and np.abs(out[0]).max() < 0.2 and out[1].tolist() == [3.0, -3.0]
    frozen = Normalizer(cfg.env, obs_dim=2, num_envs=4, gamma=0.99, training=False)
    frozen.load_state_dict(norm.state_dict())
    before = frozen.obs_rms.count
    x = np.array([[7.0, 0.0]])
    expected = np.clip((x - norm.obs_rms.mean) / np.sqrt(norm.obs_rms.var + 1e-8), -3, 3)
    np.testing.assert_allclose(frozen.obs(x), expected, rtol=1e-6)
    np.testing.assert_allclose(frozen.obs(x), expected, rtol=1e-6)
    assert frozen.obs_rms.count == before
