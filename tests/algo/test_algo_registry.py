"""Registries, the public surface of ppokit.algo, and its import purity."""

import subprocess
import sys
from pathlib import Path

import pytest

import ppokit.algo as algo
from ppokit.algo import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
    get_advantage_estimator,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_kinds():
    assert ADVANTAGE_ESTIMATORS.kind == "advantage estimator"
    assert AGG_MODES.kind == "aggregation mode"
    assert KL_ESTIMATORS.kind == "KL estimator"
    assert POLICY_LOSSES.kind == "policy loss"


def test_registered_names():
    assert ADVANTAGE_ESTIMATORS.names() == ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
    assert POLICY_LOSSES.names() == (
        "clip",
        "penalty",
        "cispo",
        "dppo_tv",
        "dppo_kl",
        "gpg",
        "dro",
        "sapo",
        "geo_mean",
        "clip_cov",
        "kl_cov",
    )
    assert "vanilla" in POLICY_LOSSES and "vanilla" not in POLICY_LOSSES.names()
    assert "nope" not in ADVANTAGE_ESTIMATORS and 3 not in ADVANTAGE_ESTIMATORS


def test_unknown_name_message_is_one_line_with_suggestion_and_valid_names():
    with pytest.raises(UnknownNameError) as info:
        get_advantage_estimator("gea")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("unknown advantage estimator 'gea'; did you mean 'gae'? valid: gae, grpo, rloo, ")
    assert "reinforce_plus_plus" in msg
    assert isinstance(info.value, ValueError) and not isinstance(info.value, KeyError)
    assert info.value.suggestion == "gae" and "grpo" in info.value.valid
    with pytest.raises(
        UnknownNameError,
        match=r"^unknown policy loss 'zzz'; valid: clip, penalty, cispo, .*, kl_cov \(aliases: ppo, vanilla, "
        r"ppo_penalty, gmpo\)$",
    ):
        POLICY_LOSSES.get("zzz")  # nothing close: no suggestion


@pytest.mark.parametrize(
    "registry,alias,name",
    [
        (ADVANTAGE_ESTIMATORS, "reinforce_plus_plus", "reinforce_pp"),
        (ADVANTAGE_ESTIMATORS, "reinforce_plus_plus_baseline", "reinforce_pp_baseline"),
        (POLICY_LOSSES, "vanilla", "clip"),
        (POLICY_LOSSES, "ppo", "clip"),
        (POLICY_LOSSES, "ppo_penalty", "penalty"),
        (KL_ESTIMATORS, "k1", "kl"),
        (KL_ESTIMATORS, "k2", "mse"),
        (KL_ESTIMATORS, "k3", "low_var_kl"),
    ],
)
def test_aliases_resolve_to_the_same_function(registry, alias, name):
    assert registry.get(alias) is registry.get(name)
    assert registry.canonical(alias) == name


def test_registry_behaviour():
    r = Registry("widget")

    @r.register("a", "alpha")
    def fa():
        return 1

    assert r.get("alpha") is fa and "a" in r and len(r) == 1 and list(r) == ["a"]
    assert r.names(include_aliases=True) == ("a", "alpha")
    with pytest.raises(ValueError, match="already registered"):
        r.register("alpha")
    with pytest.raises(UnknownNameError, match="unknown widget 'alpah'; did you mean 'alpha'"):
        r.get("alpah")
    with pytest.raises(UnknownNameError, match="unknown widget None"):
        r.get(None)


def test_all_is_complete_and_documented():
    import types

    public = {n for n in dir(algo) if not n.startswith("_") and not isinstance(getattr(algo, n), types.ModuleType)}
    assert set(algo.__all__) == public
    assert len(algo.__all__) == len(set(algo.__all__))
    # the functions named like their modules are what the package exports
    for n in ("aggregate", "policy_loss", "value_loss"):
        assert callable(getattr(algo, n)) and not isinstance(getattr(algo, n), types.ModuleType)
    missing_doc = [n for n in algo.__all__ if callable(getattr(algo, n)) and not getattr(algo, n).__doc__]
    assert not missing_doc


def test_import_does_not_pull_in_heavy_frameworks():
    code = (
        "import sys, ppokit.algo\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'transformers', 'gymnasium', 'gym', 'peft', 'safetensors', 'yaml', 'pydantic', 'rich', 'matplotlib'})\n"
        "print(','.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"ppokit.algo imported: {res.stdout.strip()} {res.stderr[-2000:]}"
