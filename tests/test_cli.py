"""The command line: lazy start-up, help, exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_help_and_config_commands_do_not_import_torch():
    code = (
        "import sys\nfrom ppokit.cli import main\n"
        "for argv in (['--help'], ['train', '--help'], ['config', 'list'], ['config', 'show', 'cartpole']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print('torch' in sys.modules, 'gymnasium' in sys.modules)"
    )
    proc = run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False False"


def test_importing_the_cli_loads_no_command_s_dependencies():
    """Every command starts by importing ppokit.cli: the config's pydantic, the run directory and the
    model-path modules load in the command that needs them."""
    heavy = ("pydantic", "ppokit.persistence.rundir", "torch")
    proc = run(f"import sys, ppokit.cli\nprint(sorted(m for m in {heavy!r} if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_bad_names_and_paths_are_answered_before_torch_is_imported(tmp_path):
    """A typo in a preset, a key, a task or a path: one line within a fraction of a second, not after
    seconds of importing torch and transformers."""
    missing = str(tmp_path / "missing")
    cases = [
        ["train", "nosuch"],
        ["train", "cartpole", "algo.gama=0.9"],
        ["train", "cartpole", "env.id=CartPol-v1"],  # a control run's environment
        ["train", "cartpole", "env.id=Pendulum-v1", "env.vectorization=vector_entry_point"],
        ["train", "--resume", missing],
        ["eval", missing],
        ["export", missing, str(tmp_path / "out")],
        ["generate", missing, "--prompt", "Hi"],
        ["generate", str(tmp_path / "model.gguf"), "--prompt", "Hi"],
        ["chat", missing],
        ["sft", "nosuchtask", "--out", str(tmp_path / "sft")],
        ["sft", "arithmetic", "--reward", "nosuch", "--out", str(tmp_path / "sft")],
        ["train", "arith", f"model.path={missing}"],  # a language-model run's own inputs
        ["train", "arith", f"data.prompts={missing}.jsonl"],
        ["train", "arith", "data.reward=nosuch"],
        ["train", "tictactoe", "textenv.env=nosuch"],
        ["train", "tictactoe", "textenv.env=textarena:TicTacToe-v1"],  # an unknown TextArena game
        ["train", "tictactoe", "textenv.env=textarena:Wordle-v0"],  # one that needs the network
        ["train", "tictactoe", f"model.path={missing}"],
        ["train", "arith", "--resume"],  # no run.name: no directory to resume
        ["train", "arith", "--resume", "--name", "nosuch", "--output-dir", str(tmp_path)],
    ]
    code = (
        "import contextlib, io, sys\nfrom ppokit.cli import main\n"
        f"for argv in {cases!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        status = main(argv)\n"
        "    lines = len(err.getvalue().strip().splitlines())\n"
        "    print(status, lines, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    proc = run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == ["2 1 False False"] * len(cases), proc.stdout


def test_import_lets_idle_openmp_workers_sleep_soon_unless_the_user_chose():
    """The fused CPU kernels' threads need the cores PyTorch's OpenMP workers spin on."""
    import os

    code = "import os, ppokit; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    cases = (
        ({}, "PASSIVE 5000"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE None"),  # the user's policy, OpenMP's spin
        ({"GOMP_SPINCOUNT": "100"}, "PASSIVE 100"),  # the user's spin count
        ({"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "7"}, " 7"),
    )  # OpenMP's default policy
    for preset, expected in cases:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**env, **preset}
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.rstrip("\n") == expected, preset


def test_help_lists_the_commands():
    proc = subprocess.run([sys.executable, "-m", "ppokit", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for command in ("train", "eval", "config", "demo"):
        assert command in proc.stdout


def test_usage_error_exits_2():
    proc = subprocess.run([sys.executable, "-m", "ppokit", "train"], capture_output=True, text=True)
    assert proc.returncode == 2 and "CONFIG" in proc.stderr


def test_config_fields_describes_every_field():
    proc = subprocess.run([sys.executable, "-m", "ppokit", "config", "fields"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "algo.gae_lambda = 0.95" in proc.stdout and "aliases: lam" in proc.stdout


def test_config_list_says_what_each_workload_trains(capsys):
    """Each preset described by its own workload: a multi-turn preset by its environment (not as
    the single-turn prompts it does not use)."""
    from ppokit.cli import main

    assert main(["config", "list"]) == 0
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["cartpole"] == ["control", "CartPole-v1"]
    assert rows["arith"] == ["lm", "arithmetic:digits=2 on model tiny"]
    assert rows["tictactoe"] == ["textenv", "tictactoe episodes against random on model tiny"]
    assert rows["frozenlake"][0] == "textenv" and rows["frozenlake"][1].startswith("frozenlake episodes")


def cli(capsys, *argv: str) -> tuple[int, str]:
    """Run ``ppokit ARGV`` in-process: (exit status, stderr)."""
    from ppokit.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_seed_options_have_the_config_bound():
    from ppokit import config
    from ppokit.commands import arguments

    assert arguments.SEED_MAX == config.SEED_MAX


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "RUN", "--seed", "-1"], "argument --seed: must be between 0 and 9223372036854775807 (got -1)"),
        (["eval", "RUN", "--seed", str(2**63)], "argument --seed: must be between 0"),
        (["eval", "RUN", "--episodes", "0"], "argument --episodes: must be >= 1 (got 0)"),
        (["eval", "RUN", "--prompts", "-3"], "argument --prompts: must be >= 1 (got -3)"),
        (["sft", "arithmetic", "--out", "o", "--batch-size", "0"], "argument --batch-size: must be >= 1 (got 0)"),
        (["sft", "arithmetic", "--out", "o", "--lr", "nan"], "argument --lr: must be a finite number > 0 (got nan)"),
        (["sft", "arithmetic", "--out", "o", "--lr=-1e-3"], "argument --lr: must be a finite number > 0"),
        (["sft", "arithmetic", "--out", "o", "--seed", "-2"], "argument --seed: must be between 0"),
    ],
)
def test_numeric_options_are_checked_before_anything_runs(capsys, argv, message):
    code, err = cli(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_overrides_may_follow_options(capsys):
    from ppokit.cli import build_parser, parse_args

    args = parse_args(build_parser(), ["train", "cartpole", "seed=1", "--name", "x", "algo.gamma=0.9", "seed=2"])
    assert (args.config, args.name, args.overrides) == ("cartpole", "x", ["seed=1", "algo.gamma=0.9", "seed=2"])
    args = parse_args(build_parser(), ["train", "cartpole", "seed=1", "--resume", "seed=2", "algo.gamma=0.9"])
    assert (args.resume, args.overrides) == (True, ["seed=1", "seed=2", "algo.gamma=0.9"])  # not RUN_DIR seed=2
    assert parse_args(build_parser(), ["train", "--resume", "runs/x"]).resume == "runs/x"
    code, err = cli(capsys, "config", "show", "cartpole", "--no-such-option", "algo.gamma=0.9")
    assert code == 2 and err == (
        "ppokit: error: config show: unrecognized arguments: --no-such-option (see ppokit config show --help)\n"
    )


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["eval", "RUN", "--episodes", "abc"],
            "ppokit: error: eval: argument --episodes: invalid int value: 'abc' (see ppokit eval --help)",
        ),
        (["demo", "--foo"], "ppokit: error: demo: unrecognized arguments: --foo (see ppokit demo --help)"),
        (["eval", "RUN", "extra"], "ppokit: error: eval: unrecognized arguments: extra (see ppokit eval --help)"),
        (["frob"], "ppokit: error: argument COMMAND: invalid choice: 'frob'"),
        (["config", "show"], "ppokit: error: config show: the following arguments are required: NAME (see"),
    ],
)
def test_usage_errors_are_one_line(capsys, argv, line):
    code, err = cli(capsys, *argv)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith(line), err


def test_name_and_output_dir_options_are_strings_as_given(capsys, monkeypatch):
    from ppokit import cli as cli_mod
    from ppokit.commands import train
    from ppokit.config import load_config

    given = []
    monkeypatch.setattr(train, "run_training", lambda source, overrides, resume: given.append(overrides) or 0)
    assert cli_mod.main(["train", "cartpole", "--name", "2024", "--output-dir", "yes"]) == 0
    cfg = load_config("cartpole", given[-1])
    assert (cfg.run.name, cfg.run.output_dir) == ("2024", "yes")
    cli_mod.main(["train", "cartpole", "--name", ""])
    assert given[-1] == ['run.name=""']  # an error in load_config, not "no name"
