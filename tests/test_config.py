"""Configuration: loading, aliases, overrides, validation messages."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ppokit import config as C
from ppokit.errors import ConfigError

BAD_CONFIGS = sorted((Path(__file__).parent / "bad_inputs" / "config").glob("*.yaml"))


def expected_message(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path} must start with '# expect: <message>'"
    return first[len("# expect: ") :]


def test_defaults_follow_seed_000():
    # The hyperparameter names and defaults of the UnstableBaselines PPO table.
    a, t = C.AlgoConfig(), C.TrainConfig()
    # (its micro-batch of 1 is what ppokit's "auto" falls back to where no run has sized it)
    assert (t.epochs, t.batch_size, t.micro_batch_size, t.learning_rate) == (2, 256, "auto", 1e-5)
    assert C.build_config([{"workload": "lm"}]).micro_batch_size == 1
    assert (t.lr_scheduler_type, t.lr_warmup_ratio, t.grad_clip) == ("constant", 0.01, 0.2)
    assert (a.upper_clip_ratio, a.lower_clip_ratio, a.entropy_coeff, a.value_coeff) == (0.4, 0.2, 0.0, 0.5)
    assert (a.beta, t.infer_micro_batch_size, t.critic_learning_rate, a.clip_value) == (0.0, "auto", 1e-5, 0.2)
    assert (a.gamma, a.gae_lambda, a.normalize_adv) == (0.99, 0.95, True)


def test_every_field_has_a_description():
    rows = C.describe_fields()
    assert len(rows) > 40
    missing = [path for path, _, _, description in rows if not description]
    assert not missing


@pytest.mark.parametrize(
    "alias, value, path",
    [
        ("algo.lam", 0.9, ("algo", "gae_lambda")),
        ("algo.clip_ratio_low", 0.1, ("algo", "lower_clip_ratio")),
        ("algo.clip_ratio_high", 0.3, ("algo", "upper_clip_ratio")),
        ("algo.entropy_bonus", 0.01, ("algo", "entropy_coeff")),
        ("algo.value_clip", 0.5, ("algo", "clip_value")),
        ("algo.normalize_advantages", False, ("algo", "normalize_adv")),
        ("algo.adv_type", "gae", ("algo", "adv_estimator")),
        ("algo.loss_agg_func", "seq-mean-token-mean", ("algo", "loss_agg_mode")),
        ("train.ppo_epochs", 4, ("train", "epochs")),
        ("train.max_grad_norm", 1.0, ("train", "grad_clip")),
        ("train.total_timesteps", 5000, ("train", "total_steps")),
        ("env.n_steps", 64, ("env", "num_steps")),
    ],
)
def test_aliases_from_other_frameworks(alias, value, path):
    cfg = C.load_config("cartpole", [f"{alias}={value}"])
    section, name = path
    assert getattr(getattr(cfg, section), name) == value


def test_clip_ratio_sets_both_bounds_and_use_kl_loss_false_zeroes_beta():
    cfg = C.build_config([{"algo": {"clip_ratio": 0.15, "use_kl_loss": False, "kl_loss_coef": 0.3}}])
    assert cfg.algo.lower_clip_ratio == cfg.algo.upper_clip_ratio == 0.15
    assert cfg.algo.beta == 0.0


def test_verl_estimator_names_are_accepted():
    assert (
        C.canonicalize({"algo": {"adv_estimator": "reinforce_plus_plus"}}, C.Config, "")["algo"]["adv_estimator"]
        == "reinforce_pp"
    )


def test_overrides_parse_yaml_values_and_win_over_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"algo": {"gamma": 0.9}, "network": {"hidden_sizes": [32]}}))
    cfg = C.load_config(
        str(path),
        ["algo.gamma=0.95", "network.hidden_sizes=[16, 16]", "run.name=null", "algo.normalize_adv=false", "seed=7"],
    )
    assert cfg.algo.gamma == 0.95 and cfg.network.hidden_sizes == [16, 16]
    assert cfg.algo.normalize_adv is False and cfg.seed == 7 and cfg.run.name is None
    assert cfg.preset == "run"


def test_a_value_ending_in_a_colon_stays_text():
    """``data.prompts=reasoning_gym:`` is a source named without its task (refused later by the
    source, naming the form), not YAML's mapping ``{reasoning_gym: null}``; a flow mapping stays one."""
    assert C.parse_overrides(["data.prompts=reasoning_gym:"]) == {"data": {"prompts": "reasoning_gym:"}}
    assert C.parse_overrides(["env.kwargs={a: 1}"]) == {"env": {"kwargs": {"a": 1}}}
    assert C.parse_overrides(["env.kwargs=a: 1"]) == {"env": {"kwargs": {"a": 1}}}


def test_alias_in_override_replaces_canonical_name_in_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algo:\n  gae_lambda: 0.5\n")
    assert C.load_config(str(path), ["algo.lam=0.7"]).algo.gae_lambda == 0.7


def test_control_workload_defaults_and_derived_batch():
    cfg = C.load_config(None, ["env.num_envs=4", "env.num_steps=64"])
    assert cfg.train.batch_size == 256 and cfg.train.learning_rate == 3e-4 and cfg.micro_batch_size == 256
    assert cfg.iterations == 100_000 // 256
    # an explicit workload default is still overridable
    assert C.load_config(None, ["train.learning_rate=0.01"]).train.learning_rate == 0.01


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = C.load_config("cartpole", ["seed=5"])
    path = tmp_path / "resolved.yaml"
    path.write_text(cfg.to_yaml())
    again = C.load_config(str(path))
    assert again.to_dict() == cfg.to_dict()


def test_config_names_match_algo_registries():
    from typing import get_args

    from ppokit import algo

    # gigpo compares the turns of multi-turn episodes (ppokit.algo.turns), not single-turn samples
    assert set(get_args(C.AdvEstimatorName)) - {"gigpo"} <= set(algo.ADVANTAGE_ESTIMATORS.names())
    assert "gigpo" in algo.turns.GROUP_ESTIMATORS
    assert set(get_args(C.AggModeName)) == set(algo.AGG_MODES.names())
    kl_names = set(get_args(C.KLEstimatorName)) - {"full"}
    assert kl_names <= set(algo.KL_ESTIMATORS.names(include_aliases=True))
    assert set(get_args(C.PolicyLossName)) == set(algo.POLICY_LOSSES.names(include_aliases=True))
    for alias, name in C.POLICY_LOSS_ALIASES.items():
        assert algo.POLICY_LOSSES.canonical(alias) == name
        assert C.AlgoConfig(loss_mode=alias).loss_mode == name
    assert set(C.TOKEN_RATIO_LOSSES) == set(algo.POLICY_LOSSES.names()) - {"clip", "penalty"}


@pytest.mark.parametrize("path", BAD_CONFIGS, ids=[p.stem for p in BAD_CONFIGS])
def test_bad_config_gives_its_message(path):
    with pytest.raises(ConfigError) as info:
        C.load_config(str(path))
    assert expected_message(path) in str(info.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.gamma"], "override 'algo.gamma' must look like section.key=value"),
        (["algo..gamma=1"], "must look like section.key=value"),
        (["algo=1", "algo.gamma=0.5"], "conflicts with an earlier override of 'algo'"),
    ],
)
def test_bad_overrides(overrides, message):
    with pytest.raises(ConfigError, match=message):
        C.load_config("cartpole", overrides)


def test_unknown_preset_suggests_a_name():
    with pytest.raises(ConfigError, match="unknown preset 'cartpol'; did you mean 'cartpole'"):
        C.load_config("cartpol")
    with pytest.raises(ConfigError, match="unknown preset 'zzz'; presets: acrobot, "):  # no close name
        C.load_config("zzz")


def test_missing_yaml_file():
    with pytest.raises(ConfigError, match="config file 'nope/missing.yaml' does not exist"):
        C.load_config("nope/missing.yaml")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ppokit", *args], capture_output=True, text=True, timeout=120)


def test_bad_configs_exit_2_with_one_line_and_no_traceback():
    # One subprocess per kind of failure is enough to prove the CLI path; the messages
    # themselves are checked in-process above.
    for path in BAD_CONFIGS[:6] + [p for p in BAD_CONFIGS if p.stem == "invalid_yaml"]:
        proc = run_cli("config", "show", str(path))
        assert proc.returncode == 2, (path, proc.stderr)
        assert "Traceback" not in proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ppokit: error: "), proc.stderr
        assert expected_message(path) in lines[0]


def test_config_show_prints_resolved_yaml():
    proc = run_cli("config", "show", "cartpole", "algo.gamma=0.97")
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["algo"]["gamma"] == 0.97 and shown["env"]["id"] == "CartPole-v1"


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    # YAML 1.1 reads 2e5 and 1e-4 as strings; the CLI's own example uses train.total_steps=2e5.
    cfg = C.load_config(
        "cartpole",
        [
            "train.total_steps=2e5",
            "train.learning_rate=1e-4",
            "network.init_log_std=-3E2",
            "network.hidden_sizes=[1e2, 64]",
        ],
    )
    assert cfg.train.total_steps == 200_000 and isinstance(cfg.train.total_steps, int)
    assert cfg.train.learning_rate == 1e-4 and cfg.network.init_log_std == -300.0
    assert cfg.network.hidden_sizes == [100, 64]
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  learning_rate: 3e-4\n")
    assert C.load_config(str(path)).train.learning_rate == 3e-4
    with pytest.raises(ConfigError, match="train.total_steps: .*fractional part"):
        C.load_config("cartpole", ["train.total_steps=2.5e0"])
    assert C.load_config("cartpole", ["run.name=1.0.0"]).run.name == "1.0.0"  # not a number


@pytest.mark.parametrize(
    "override, message",
    [
        ("network.hidden_sizes=[-4]", "network.hidden_sizes.0: Input should be greater than or equal to 1"),
        ("network.hidden_sizes=[64, 0]", "network.hidden_sizes.1: Input should be greater than or equal to 1"),
        ("seed=99999999999999999999999", "seed: Input should be less than or equal to 9223372036854775807"),
        ("train.learning_rate=.inf", "train.learning_rate: Input should be a finite number"),
        ("algo.entropy_coeff=.nan", "algo.entropy_coeff: Input should be a finite number"),
        ("network.init_log_std=.nan", "network.init_log_std: Input should be a finite number"),
        ("rollout.temperature=.inf", "rollout.temperature: Input should be a finite number"),
        ("algo.clip_ratio_c=-.inf", "algo.clip_ratio_c: Input should be a finite number"),
        ("train.epochs=true", "train.epochs: expected a number, got true"),
        ("algo.gamma=false", "algo.gamma: expected a number, got false"),
        ("network.hidden_sizes=[true]", "network.hidden_sizes: expected a number"),
    ],
)
def test_numbers_are_in_range_finite_and_not_booleans(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        C.load_config("cartpole", [override])


def test_every_float_field_rejects_non_finite_values():
    for path, *_ in C.describe_fields():
        section, _, name = path.rpartition(".")
        model = C._model_at(tuple(section.split("."))) if section else C.Config
        annotation = model.model_fields[name].annotation
        if C._takes_numbers(annotation) and "list" not in str(annotation):
            # (a field that takes a count or a word says so: "must be a positive integer or auto")
            with pytest.raises(ConfigError, match="finite number|must be a positive integer"):
                C.load_config("cartpole", [f"{path}=.nan"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["algo.gamma=5", "algo.gae_lambda=7"],
            "algo.gamma: Input should be less than or equal to 1 (got 5); "
            "algo.gae_lambda: Input should be less than or equal to 1 (got 7)",
        ),
        (["model.lora_target_modules=5"], "model.lora_target_modules: must be a string or a list of strings (got 5)"),
        (
            ["model.lora_target_modules=[q_proj, 5]"],
            "model.lora_target_modules: must be a string or a list of strings (got ['q_proj', 5])",
        ),
    ],
)
def test_validation_errors_make_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        C.load_config("cartpole", overrides)
    assert str(info.value) == message


def test_a_directory_neither_hides_a_preset_nor_passes_for_a_missing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cartpole").mkdir()
    (tmp_path / "adir.yaml").mkdir()
    assert C.load_config("cartpole").preset == "cartpole"
    with pytest.raises(ConfigError, match="config 'adir.yaml' is a directory; give a YAML file or a preset"):
        C.load_config("adir.yaml")
    with pytest.raises(ConfigError, match="config 'cartpole/' is a directory"):
        C.load_config("cartpole/")


def test_a_bound_given_by_clip_ratio_and_by_name_names_clip_ratio():
    with pytest.raises(
        ConfigError,
        match=re.escape("algo.lower_clip_ratio is given twice (as 'clip_ratio' and 'lower_clip_ratio'); keep one"),
    ):
        C.load_config("cartpole", ["algo.clip_ratio=0.3", "algo.lower_clip_ratio=0.1"])


def test_a_key_given_twice_in_a_yaml_file_is_an_error(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("algo: {gamma: 0.9}\nseed: 2\nalgo: {gamma: 0.8}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path} line 3: key 'algo' is given twice (first on line 1)")):
        C.load_config(str(path))
    path.write_text("algo:\n  gamma: 0.9\n  gamma: 0.8\n")
    with pytest.raises(ConfigError, match="line 3: key 'gamma' is given twice"):
        C.load_config(str(path))
    with pytest.raises(ConfigError, match="key 'a' is given twice"):
        C.load_config("cartpole", ["env.kwargs={a: 1, a: 2}"])
    path.write_text("defaults: &d {gamma: 0.9, gae_lambda: 0.5}\nalgo:\n  <<: *d\n  gamma: 0.8\n")
    assert C.read_yaml(path)["algo"] == {"gamma": 0.8, "gae_lambda": 0.5}  # a merge key may be overridden


def test_an_override_inside_kwargs_keeps_the_preset_s_other_arguments(tmp_path):
    """``textenv.kwargs.opponent=self`` changes one argument of the preset's environment (it used to
    replace all of them, and the run silently played TextArena's whole-transcript view); a whole
    mapping, from the command line or a file, still replaces the preset's."""
    preset = C.load_config("smollm2_tictactoe", []).textenv.kwargs
    one = C.load_config("smollm2_tictactoe", ["textenv.kwargs.opponent=self", "textenv.kwargs.extra.depth=2"])
    assert one.textenv.kwargs == {**preset, "opponent": "self", "extra": {"depth": 2}}
    assert type(one.textenv.kwargs["extra"]) is dict
    whole = C.load_config("smollm2_tictactoe", ["textenv.kwargs={opponent: self}"])
    assert whole.textenv.kwargs == {"opponent": "self"}
    path = tmp_path / "mine.yaml"
    path.write_text("workload: lm\ntextenv:\n  env: tictactoe\n  kwargs: {opponent: heuristic}\n")
    assert C.load_config(str(path), ["textenv.kwargs.seat=1"]).textenv.kwargs == {"opponent": "heuristic", "seat": 1}
    cartpole = C.load_config("cartpole", ["env.kwargs.sutton_barto_reward=true"])
    assert cartpole.env.kwargs == {"sutton_barto_reward": True}


def test_naming_another_environment_drops_the_earlier_layers_arguments(tmp_path):
    """The tictactoe preset's ``policy_seat: x`` belongs to its built-in game: over a TextArena game
    the wrapper refused it, naming a value the user never wrote. An environment another constructor
    builds starts from its own arguments (those its layer gives); the same environment, or another
    TextArena game (one wrapper builds them all), keeps the earlier ones."""
    kuhn = C.load_config("tictactoe", ["textenv.env=textarena:KuhnPoker-v0"]).textenv
    assert kuhn.env == "textarena:KuhnPoker-v0" and kuhn.kwargs == {}
    dotted = C.load_config("tictactoe", ["textenv.env=textarena:KuhnPoker-v0", "textenv.kwargs.opponent=self"])
    assert dotted.textenv.kwargs == {"opponent": "self"}
    same = C.load_config("tictactoe", ["textenv.env=tictactoe", "textenv.kwargs.opponent=self"])
    assert same.textenv.kwargs == {"opponent": "self", "policy_seat": "x"}
    preset = C.load_config("smollm2_tictactoe", []).textenv.kwargs
    assert C.load_config("smollm2_tictactoe", ["textenv.env=textarena:KuhnPoker-v0"]).textenv.kwargs == preset
    assert C.load_config("smollm2_tictactoe", ["textenv.env=tictactoe"]).textenv.kwargs == {}
    path = tmp_path / "cartpole.yaml"
    path.write_text("env:\n  id: CartPole-v1\n  kwargs: {sutton_barto_reward: true}\n")
    assert C.load_config(str(path), ["env.id=Acrobot-v1"]).env.kwargs == {}
    assert C.load_config(str(path), ["env.id=CartPole-v1"]).env.kwargs == {"sutton_barto_reward": True}


@pytest.mark.parametrize("limit", [-5, 50])
def test_the_time_limit_is_not_an_environment_argument(limit):
    """gymnasium.make takes ``max_episode_steps`` beside the environment's own arguments, unchecked (-5
    ended every episode after one step) and unseen by the evaluation's limit: it has its own field."""
    with pytest.raises(ConfigError, match=rf"env.kwargs: max_episode_steps={limit} is the time limit: set env.max_"):
        C.load_config("cartpole", [f"env.kwargs.max_episode_steps={limit}"])


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "/tmp/x"])
def test_run_name_is_a_plain_directory_name(name):
    with pytest.raises(ConfigError, match="run.name: must be a plain directory name .*run.output_dir"):
        C.load_config("cartpole", [f"run.name={name!r}"])


def test_a_config_file_gives_each_model_mode_its_own_settings(tmp_path):
    assert C.load_config("arith", []).train.learning_rate == 0.002  # lora
    full = C.load_config("arith", ["model.mode=full"])
    assert full.train.learning_rate == 1e-4 and full.train.critic_learning_rate == 0.005
    assert C.load_config("arith", ["model.mode=full", "train.learning_rate=3e-4"]).train.learning_rate == 3e-4
    path = tmp_path / "run.yaml"
    path.write_text(
        "workload: lm\nmodel: {mode: full}\ntrain: {learning_rate: 0.01, epochs: 3}\n"
        "model_mode:\n  lora: {train: {epochs: 1}}\n  full: {train: {lr: 2.0e-5}}\n"  # (an alias inside)
    )
    cfg = C.load_config(str(path), [])
    assert (cfg.train.learning_rate, cfg.train.epochs) == (2e-5, 3)
    lora = C.load_config(str(path), ["model.mode=lora"])
    assert (lora.train.learning_rate, lora.train.epochs) == (0.01, 1)


@pytest.mark.parametrize(
    "section, message",
    [
        ("model_mode: [full]", "model_mode must map a model mode (lora, full) to config sections"),
        ("model_mode: {qlora: {train: {epochs: 1}}}", "model_mode.qlora is not a model mode; modes: lora, full"),
        ("model_mode: {full: {train: {epochz: 1}}}", "unknown key 'train.epochz'"),
    ],
)
def test_a_bad_model_mode_section_is_one_line(tmp_path, section, message):
    path = tmp_path / "run.yaml"
    path.write_text(f"workload: lm\nmodel: {{mode: full}}\n{section}\n")
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        C.load_config(str(path), [])
    assert "\n" not in str(err.value)


def test_rejection_rule_names_match_algo():
    from ppokit import algo

    assert C.REJECTION_RULE_NAMES == algo.REJECTION_RULES


@pytest.mark.parametrize(
    "rules, threshold, parsed",
    [
        ("seq_mean_k3", 0.01, (("seq_mean_k3", None, 0.01),)),
        ("seq_mean_k1", "0.999_1.001", (("seq_mean_k1", 0.999, 1.001),)),
        ("seq_sum_k1", 2, (("seq_sum_k1", 0.5, 2.0),)),  # one number U: the band [1/U, U]
        (" token_k1 , seq_max_k3 ", "0.5_2.0, 0.1", (("token_k1", 0.5, 2.0), ("seq_max_k3", None, 0.1))),
        ("token_k2,seq_sum_k2", "0.2", (("token_k2", None, 0.2), ("seq_sum_k2", None, 0.2))),  # one for all
        ("seq_mean_k3,seq_mean_k3", 0.01, (("seq_mean_k3", None, 0.01),)),  # a repeat dropped
        (None, None, ()),
    ],
)
def test_verl_rejection_syntax_parses(rules, threshold, parsed):
    assert C.parse_rejection_rules(rules, threshold) == parsed


def test_verl_names_of_the_rollout_correction_fields():
    cfg = C.load_config(
        "arith", ["algo.rollout_rs=seq_mean_k3", "algo.rollout_rs_threshold=0.01", "algo.bypass_mode=true"]
    )
    a = cfg.algo
    assert (a.rollout_correction_rs, a.rollout_correction_rs_threshold, a.rollout_correction_bypass) == (
        "seq_mean_k3",
        0.01,
        True,
    )
    assert a.rejection_rules == (("seq_mean_k3", None, 0.01),)
    assert C.load_config("arith", []).algo.rejection_rules == ()  # the defaults: no rule, no bypass


def test_dynamic_sampling_takes_a_switch_a_section_and_verls_names(tmp_path):
    base = ["workload=lm", "train.iterations=1", "algo.group_size=4"]
    assert not C.load_config(None, base).rollout.dynamic_sampling.enable  # off by default
    on = C.load_config(None, [*base, "rollout.dynamic_sampling=true"]).rollout.dynamic_sampling
    assert on.enable and on.metric == "reward" and on.max_gen_batches == 10
    verl_names = {"filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 0}}
    verl = C.build_config([{**C.parse_overrides(base), "rollout": verl_names}]).rollout.dynamic_sampling
    assert verl.enable and verl.metric == "verifier" and verl.max_gen_batches == 0
    named = C.load_config(None, [*base, "rollout.dynamic_sampling.metric=seq_reward"])
    assert named.rollout.dynamic_sampling.metric == "reward"
    # a file's switch and a command line's setting merge (true is {enable: true} before merging)
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  dynamic_sampling: true\n")
    merged = C.load_config(str(path), [*base, "rollout.dynamic_sampling.metric=score"]).rollout.dynamic_sampling
    assert merged.enable and merged.metric == "verifier"
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling.max_gen_batches: .* greater than or equal to 0"):
        C.load_config(None, [*base, "rollout.dynamic_sampling.max_gen_batches=-1"])


def test_multi_turn_k_steps_off_and_dynamic_sampling_run_on_rollout_workers_but_not_together():
    base = ["workload=lm", "textenv.env=frozenlake", "train.batch_size=8", "rollout.off_policy_steps=2"]
    cfg = C.load_config(None, [*base, "cluster.rollout_workers=2"])
    assert (cfg.rollout.off_policy_steps, cfg.cluster.rollout_workers) == (2, 2)
    grouped = [*base, "algo.adv_estimator=grpo", "algo.group_size=4", "rollout.dynamic_sampling=true"]
    assert C.load_config(None, grouped).rollout.dynamic_sampling.enable  # in the training process
    synchronous = [*grouped, "rollout.off_policy_steps=0", "cluster.rollout_workers=2"]
    assert C.load_config(None, synchronous).rollout.dynamic_sampling.enable  # on the workers
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling with rollout.off_policy_steps=2"):
        C.load_config(None, [*grouped, "cluster.rollout_workers=1"])  # its further draws: newer weights
