"""The bad-input corpus: every malformed input under tests/bad_inputs/ through the real CLI.

Each case must end with exit status 2 and exactly one line on stderr, ``ppokit: error:
...``, containing the message the case names (no traceback). See
tests/bad_inputs/README.md for the layout and the builder steps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ppokit.cli import main

CORPUS = Path(__file__).parent / "bad_inputs"
CONFIG_CASES = sorted((CORPUS / "config").glob("*.yaml"))
FOLDER_KINDS = ("data", "checkpoint", "model", "memory")
FOLDER_CASES = sorted(p.parent for kind in FOLDER_KINDS for p in (CORPUS / kind).glob("*/case.yaml"))
# The tiny Llama of the LM tests (tests/lm/conftest.py: TEST_TINY_SPEC).
TINY_SPEC = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 64, "seed": 0}


# ----------------------------------------------------------------------------- fixtures
# Built at most once per session and only when a case copies them: a trained control run,
# the tiny model, a trained LM run. Cases copy them; these stay untouched.
@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input_sources")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = BUILDERS[name](root, get)
        return built[name]

    return get


def _quiet_main(args: list[str]) -> None:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args) == 0


def _control_run(root: Path, get) -> Path:
    _quiet_main(
        [
            "train",
            "cartpole",
            "train.iterations=1",
            "env.eval_episodes=1",
            "run.tensorboard=false",
            "--output-dir",
            str(root),
            "--name",
            "control",
            "--no-progress",
        ]
    )
    return root / "control"


def _tiny_model(root: Path, get) -> Path:
    from ppokit.lm.model.tiny import build_tiny_model

    return build_tiny_model(root / "tiny", **TINY_SPEC)


def _lm_run(root: Path, get) -> Path:
    import torch

    threads = torch.get_num_threads()
    try:
        _quiet_main(
            [
                "train",
                "arith",
                f"model.path={get('tiny_model')}",
                "data.sft_epochs=0",
                "data.eval_size=0",
                "train.iterations=1",
                "train.batch_size=8",
                "train.mini_batch_size=8",
                "train.micro_batch_size=8",
                "algo.group_size=4",
                "rollout.max_new_tokens=4",
                "run.precision=fp32",
                "run.tensorboard=false",
                "--output-dir",
                str(root),
                "--name",
                "lm",
                "--no-progress",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    return root / "lm"


BUILDERS = {"control_run": _control_run, "tiny_model": _tiny_model, "lm_run": _lm_run}
COPY_TARGET = {"control_run": "run", "lm_run": "run", "tiny_model": "model"}


# ----------------------------------------------------------------------------- builder steps
def _set_dotted(obj: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        obj = obj[key]
    obj[last] = value


def build(case_dir: Path, steps: list[dict], sources, fill) -> None:
    """Run a case's ``build`` steps inside ``case_dir`` (a temporary copy of the case folder)."""
    for step in steps:
        ((action, arg),) = step.items()
        if action == "copy":
            shutil.copytree(sources(arg), case_dir / COPY_TARGET[arg])
        elif action == "truncate":
            path = case_dir / arg
            os.truncate(path, path.stat().st_size // 2)
        elif action == "delete":
            path = case_dir / arg
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        elif action == "write":
            (case_dir / arg["file"]).write_text(fill(arg["text"]))
        elif action == "write_latin1":
            (case_dir / arg["file"]).write_bytes(arg["text"].encode("latin-1"))
        elif action == "json":
            path = case_dir / arg["file"]
            data = json.loads(path.read_text())
            for key, value in arg.get("set", {}).items():
                _set_dotted(data, key, fill(value) if isinstance(value, str) else value)
            for key in arg.get("remove", []):
                data.pop(key)
            path.write_text(json.dumps(data))
        else:
            raise AssertionError(f"unknown build step {action!r} in {case_dir}")


# ----------------------------------------------------------------------------- running
def run_cli(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        status = main(args)
    except SystemExit as exc:  # argparse: usage errors
        status = exc.code
    return status, capsys.readouterr().err


def assert_one_line_error(status: int, err: str, expected: str) -> None:
    assert status == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ppokit: error: "), err
    assert expected in lines[0], f"\nexpected: {expected}\ngot:      {lines[0]}"


def config_expectation(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path} must start with '# expect: <message>'"
    return first[len("# expect: ") :]


@pytest.mark.parametrize("path", CONFIG_CASES, ids=[p.stem for p in CONFIG_CASES])
def test_bad_config(path, capsys):
    status, err = run_cli(["config", "show", str(path)], capsys)
    assert_one_line_error(status, err, config_expectation(path))


@pytest.mark.parametrize("case", FOLDER_CASES, ids=[f"{p.parent.name}/{p.name}" for p in FOLDER_CASES])
def test_bad_input(case, tmp_path, monkeypatch, capsys, sources):
    spec = yaml.safe_load((case / "case.yaml").read_text())
    assert set(spec) <= {"args", "expect", "build"} and spec.get("args") and spec.get("expect"), case
    case_dir = tmp_path / "case"
    shutil.copytree(case, case_dir, ignore=shutil.ignore_patterns("case.yaml"))

    def fill(text: str) -> str:
        return text.replace("{case}", str(case_dir)).replace("{tmp}", str(tmp_path))

    build(case_dir, spec.get("build", []), sources, fill)
    args = [fill(str(a)) for a in spec["args"]]
    if args[0] == "train":  # whatever a case gets through to, it writes under tmp_path
        args += ["run.tensorboard=false", "--output-dir", str(tmp_path / "runs"), "--no-progress"]
    monkeypatch.chdir(tmp_path)
    status, err = run_cli(args, capsys)
    assert_one_line_error(status, err, fill(spec["expect"]))


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("textenv_messages_without_chat_template", "gave chat messages as the observation, but data.chat_template"),
        ("textenv_message_mode_warm_start", "a warm start from demonstrations needs 'state' observations"),
    ],
)
def test_a_text_environment_s_mode_refused_writes_nothing(case, expected, tmp_path, capsys, monkeypatch):
    """Refused among the pre-start checks: no run directory is made (each used to be, with the header)."""
    folder = CORPUS / "data" / case
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    args = ["train", str(folder / "calculator.yaml"), "--output-dir", str(runs), "--no-progress"]
    status, err = run_cli(args, capsys)
    assert_one_line_error(status, err, expected)
    assert not runs.exists() or not any(runs.iterdir())


@pytest.mark.parametrize(
    "case",
    [
        "data/warm_start_without_heldout",
        "data/warm_start_file_without_heldout",
        "data/warm_start_more_examples_than_the_task_has",
        "data/heldout_more_than_the_task_has",
        "model/lora_target_not_in_the_model",
        "model/lora_target_not_in_the_model_multiturn",
        "model/lora_target_pattern_matches_nothing",
        "data/eval_opponents_on_a_one_player_env",
        "model/critic_path_missing",
    ],
)
def test_inputs_refused_before_the_start_write_nothing(case, tmp_path, capsys, monkeypatch):
    """Refused among the pre-start checks: no run directory. Each used to be refused once the run
    directory (with the tiny model built into it) existed: by the warm start (no held-out prompts,
    fewer examples than asked for), by peft (no layer of that name or pattern), by the critic's load (no
    directory) or by the evaluation before training (its opponents' environments)."""
    folder = CORPUS / case
    spec = yaml.safe_load((folder / "case.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    args = [str(a).replace("{case}", str(folder)) for a in spec["args"]]
    status, err = run_cli([*args, "--output-dir", str(runs), "--no-progress"], capsys)
    assert_one_line_error(status, err, spec["expect"].replace("{case}", str(folder)))
    assert not runs.exists() or not any(runs.iterdir())


def test_corpus_size():
    counts = {kind: len([c for c in FOLDER_CASES if c.parent.name == kind]) for kind in FOLDER_KINDS}
    counts["config"] = len(CONFIG_CASES)
    assert all(n >= 5 for n in counts.values()), counts
    assert sum(counts.values()) >= 30, counts


def test_a_data_case_through_the_console_entry_point(tmp_path):
    # The corpus runs in-process; this proves the same for a real `ppokit` process.
    case = CORPUS / "data" / "bad_json_line"
    spec = yaml.safe_load((case / "case.yaml").read_text())
    args = [str(a).replace("{case}", str(case)) for a in spec["args"]]
    proc = subprocess.run(
        [sys.executable, "-m", "ppokit", *args, "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert_one_line_error(proc.returncode, proc.stderr, spec["expect"].replace("{case}", str(case)))
