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


def test_import_lets_idle_openmp_workers_sleep_soon_unless_the_user_chose():
    """The fused CPU kernels' threads need the cores PyTorch's OpenMP workers spin on."""
    import os

    code = "import os, ppokit; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    cases = (({}, "PASSIVE 5000"),
             ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE None"),            # the user's policy, OpenMP's spin
             ({"GOMP_SPINCOUNT": "100"}, "PASSIVE 100"),                # the user's spin count
             ({"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "7"}, " 7"))     # OpenMP's default policy
    for preset, expected in cases:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**env, **preset})
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
