"""The command line: lazy start-up, help, exit codes."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_help_and_config_commands_do_not_import_torch():
    code = ("import sys\nfrom ppokit.cli import main\n"
            "for argv in (['--help'], ['train', '--help'], ['config', 'list'], ['config', 'show', 'cartpole']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, 'gymnasium' in sys.modules)")
    proc = run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False False"


def test_import_lets_idle_openmp_workers_sleep_unless_the_user_chose():
    """The fused CPU kernels' threads need the cores PyTorch's OpenMP workers spin on."""
    import os

    code = "import os, ppokit; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for preset, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env=env if preset is None else {**env, "OMP_WAIT_POLICY": preset})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == expected


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
