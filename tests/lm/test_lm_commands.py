"""``ppokit generate``, ``chat``, ``eval`` (language models) and ``reward``: driven as a user drives them.

A tiny run is trained once (LoRA actor on the tests' tiny Llama); ``generate`` and
``chat`` read prompts from standard input (a real ``python -m ppokit`` process, and in
process with a spy on the generation path), ``eval`` reports greedy and sampled metrics
whose relations are fixed by the estimator (pass@1 of samples = their mean 0/1 reward),
and ``reward`` prints a score and the failure reason with exit status 0, or one line and
exit status 2 for bad arguments.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppokit.cli import main
from ppokit.lm.generation.engine import HFEngine
from ppokit.lm.generation.factory import make_engine

PROMPTS = ["12+30=", "7+8="]


@pytest.fixture(scope="module")
def run_dir(tiny_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("commands")
    args = [
        "train",
        "arith",
        f"model.path={tiny_dir}",
        "data.sft_epochs=0",
        "data.eval_size=4",
        "train.iterations=1",
        "train.batch_size=8",
        "train.mini_batch_size=8",
        "train.micro_batch_size=8",
        "algo.group_size=4",
        "rollout.max_new_tokens=4",
        "run.precision=fp32",
        "run.tensorboard=false",
        "--output-dir",
        str(out),
        "--name",
        "run",
        "--no-progress",
    ]
    assert main(args) == 0
    return out / "run"


def ppokit(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ppokit", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def test_generate_reads_prompts_from_stdin_like_from_options(run_dir):
    from_stdin = ppokit("generate", str(run_dir), "--greedy", stdin="\n".join(PROMPTS) + "\n\n")
    assert from_stdin.returncode == 0, from_stdin.stderr
    lines = from_stdin.stdout.splitlines()
    assert lines[0] == f"[1] {PROMPTS[0]}" and f"[2] {PROMPTS[1]}" in lines
    capture = io.StringIO()
    from ppokit.commands.interactive import generate_main

    generate_main(str(run_dir), PROMPTS, greedy=True, stdout=capture)
    assert capture.getvalue() == from_stdin.stdout


def test_generate_is_the_trained_actor_through_the_rollout_engine(run_dir):
    from ppokit.config import RolloutConfig
    from ppokit.lm.model.checkpoint import load_policy
    from ppokit.lm.model.hf import load_tokenizer

    ckpt = run_dir / "checkpoint"
    policy = load_policy(ckpt)
    engine = make_engine(policy, load_tokenizer(ckpt), RolloutConfig(max_new_tokens=6))
    want = engine.generate(PROMPTS[:1], greedy=True).texts[0]
    out = io.StringIO()
    from ppokit.commands.interactive import generate_main

    generate_main(str(run_dir), PROMPTS[:1], greedy=True, max_new_tokens=6, stdout=out)
    assert out.getvalue() == want + "\n"
    # sampling options reach generation: a seed fixes the samples, another seed changes them
    a, b, c = io.StringIO(), io.StringIO(), io.StringIO()
    for stream, seed in ((a, 1), (b, 1), (c, 2)):
        generate_main(str(run_dir), PROMPTS, num_samples=3, temperature=1.5, seed=seed, stdout=stream)
    assert a.getvalue() == b.getvalue() != c.getvalue()


def test_chat_keeps_the_conversation_and_its_commands(chat_dir, monkeypatch):
    from ppokit.commands.interactive import chat_main

    seen: list[str] = []
    real = HFEngine.generate

    def spy(self, prompts, **kwargs):
        seen.extend(prompts)
        return real(self, prompts, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", spy)
    stdin = io.StringIO("1+1=\n/set max_new_tokens=3\n2+2=\n/set top_p=7\n/clear\n3+3=\n/exit\nnever read\n")
    out, err = io.StringIO(), io.StringIO()
    assert chat_main(str(chat_dir), system="add", greedy=True, stdin=stdin, stdout=out, stderr=err) == 0
    replies = out.getvalue().splitlines()
    assert len(seen) == 3
    assert seen[0] == "s:add\nu:1+1=\na:"  # the template, with the system message
    assert seen[1] == f"s:add\nu:1+1=\na:{replies[0]}\nu:2+2=\na:"  # the history goes with the next turn
    assert seen[2] == "s:add\nu:3+3=\na:"  # /clear forgot it
    assert "(max_new_tokens = 3)" in err.getvalue() and "top_p" in err.getvalue()  # /set, and a bad /set
    assert "never read" not in "".join(seen)


def test_chat_through_stdin_of_a_real_process(run_dir):
    done = ppokit("chat", str(run_dir), "--greedy", "--max-new-tokens", "3", stdin="12+30=\n7+8=\n")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) >= 2 and "no chat template" in done.stderr


def test_eval_table_and_json_for_a_run(run_dir, capsys):
    assert main(["eval", str(run_dir), "--samples", "4", "--k", "1", "2", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompts"] == 4 and result["samples"] == 4
    assert result["pass@1"] == pytest.approx(result["sampled_mean_reward"])  # unbiased pass@1 = mean of 0/1
    assert result["pass@1"] <= result["pass@2"] <= result["pass@4"]
    assert result["pass@1_greedy"] == pytest.approx(result["mean_reward"])
    assert main(["eval", str(run_dir), "--prompts", "2"]) == 0
    table = capsys.readouterr().out
    assert "mean reward (greedy)" in table and "pass@1 (greedy, reward >= 1)" in table and "prompts" in table


def test_eval_refuses_the_options_its_run_does_not_read(run_dir, capsys):
    import importlib
    import inspect

    from ppokit.commands.evaluate import EVAL_OPTIONS
    from ppokit.workloads import EVALUATORS

    assert main(["eval", str(run_dir), "--prompts", "2", "--episodes", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ppokit: error: --episodes does not apply to {run_dir}, a language-model run")
    assert "\n" not in err
    # the command passes every option it has (None when not given) ...
    from ppokit.cli import build_parser

    defaults = vars(build_parser().parse_args(["eval", "RUN"]))
    assert {name for name, value in defaults.items() if value is None} - {"resume", "overrides"} == set(EVAL_OPTIONS)
    # ... and each kind's evaluation reads exactly the options the registry says
    for kind, evaluator in EVALUATORS.items():
        function = getattr(importlib.import_module(evaluator.module), evaluator.function)
        params = inspect.signature(function).parameters.values()
        assert {p.name for p in params if p.kind is p.KEYWORD_ONLY} == evaluator.options, kind
        assert evaluator.options <= set(EVAL_OPTIONS), kind


def test_eval_of_a_text_environment_run(tmp_path, capsys):
    """``ppokit eval`` of a multi-turn run: its greedy win rate over --episodes games a side."""
    args = ["train", "tictactoe", "train.iterations=1", "data.sft_epochs=0", "textenv.eval_episodes=2"]
    args += ["textenv.stop_at_win_rate=null", "train.batch_size=16", "train.mini_batch_size=16"]
    assert main([*args, "run.name=ttt", f"run.output_dir={tmp_path}", "run.tensorboard=false"]) == 0
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "ttt"), "--episodes", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("evaluation: vs random ") and "(3 episodes each, greedy)" in out, out
    assert main(["eval", str(tmp_path / "ttt"), "--samples", "2"]) == 2
    err = capsys.readouterr().err.strip()
    run = tmp_path / "ttt"
    assert (
        err
        == f"ppokit: error: --samples does not apply to {run}, a text-environment run; it takes --device, --episodes"
    )


def test_eval_of_a_model_directory_on_a_dataset(tiny_dir, tmp_path, capsys):
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "gold": str(i + 1)}) + "\n" for i in range(5)))
    (tmp_path / "always.py").write_text(
        "def one(prompt, response, **fields):\n    return 1.0\n"
        "def half(prompt, response, answer):\n"
        "    return 0.5 if int(answer) == int(prompt[:-3]) + 1 else 0.0\n"
    )
    base = [
        "eval",
        str(tiny_dir),
        "--data",
        str(data),
        "--prompt-key",
        "question",
        "--answer-key",
        "gold",
        "--samples",
        "3",
        "--json",
        "--max-new-tokens",
        "3",
    ]
    assert main(base + ["--reward", f"{tmp_path / 'always.py'}:one"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompts"] == 5 and result["mean_reward"] == 1.0 and result["pass@3"] == 1.0
    assert result["mean_length"] <= 3
    assert main(base + ["--reward", f"{tmp_path / 'always.py'}:half"]) == 0  # gold is the answer field
    result = json.loads(capsys.readouterr().out)
    assert result["mean_reward"] == 0.5 and result["pass@1_greedy"] == 0.0 and result["pass@3"] == 0.0
    assert main(base + ["--reward", f"{tmp_path / 'always.py'}:half", "--threshold", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["pass@3"] == 1.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--samples", "2", "--k", "4"], "--k must be between 1 and --samples"),
        (["--data", "nope.jsonl", "--reward", "exact_match"], "nope.jsonl does not exist"),
        (["--data", "arithmetic", "--reward", "nosuch"], "unknown reward function 'nosuch'; built-ins: exact_match"),
        (["--temperature", "0"], "argument --temperature: must be a finite number > 0"),
        (["--top-p", "2"], "argument --top-p: must be a number in (0, 1] (got 2)"),
        (["--top-p", "nan"], "argument --top-p: must be a number in (0, 1] (got nan)"),
    ],
)
def test_eval_bad_arguments_are_one_line(run_dir, args, message, capsys):
    try:
        status = main(["eval", str(run_dir), *args])
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_eval_of_a_gguf_file_evaluates_its_converted_directory(tiny_dir, tmp_path, monkeypatch, capsys):
    """As generate and chat do: a GGUF file (or a packaged model's name) stands for its converted
    directory (the conversion itself is tested on the real model, tests/lm/test_real_model.py)."""
    from ppokit.lm.model import gguf

    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"GGUF")
    asked = []
    monkeypatch.setattr(gguf, "converted_directory", lambda path, what, **kw: asked.append((path, what)) or tiny_dir)
    args = ["eval", str(model_file), "--data", "arithmetic", "--prompts", "3", "--max-new-tokens", "2", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["prompts"] == 3
    assert asked == [(str(model_file), "the model file")]
    assert main(["eval", str(tmp_path / "notes.txt")]) == 2  # not there at all
    assert "run directory" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("x")
    assert main(["eval", str(tmp_path / "notes.txt")]) == 2  # a file that is not a model
    assert f"run directory {tmp_path / 'notes.txt'} is a file; give a run directory" in capsys.readouterr().err


def test_train_reads_its_prompts_once_before_importing_the_model(tmp_path, monkeypatch, capsys):
    """The registry's light read (ppokit.lm.inputs.read_prompt_run) hands the records to the workload,
    which reads them no second time."""
    from ppokit.lm import inputs

    reads = []
    real = inputs.load_prompts
    monkeypatch.setattr(
        inputs, "load_prompts", lambda source, split, **kw: reads.append(split) or real(source, split, **kw)
    )
    args = ["train", "arith", "data.sft_epochs=0", "train.iterations=1", "data.eval_size=4", "train.batch_size=8"]
    assert main([*args, "train.mini_batch_size=8", "run.progress=false", f"run.output_dir={tmp_path}"]) == 0
    assert reads.count("train") == 1, reads
    capsys.readouterr()


def test_a_model_directory_needs_data(tiny_dir, capsys):
    assert main(["eval", str(tiny_dir)]) == 2
    assert "--data is needed with a model directory" in capsys.readouterr().err


def test_reward_command_prints_score_and_reason(tmp_path):
    done = ppokit(
        "reward",
        "countdown",
        "--prompt",
        "p",
        "--response",
        "<answer>3 * 7</answer>",
        "--field",
        "numbers=[3, 5, 7]",
        "--field",
        "target=15",
    )
    assert done.returncode == 0 and done.stdout == "score: 0\nreason: wrong value\n", done.stderr
    (tmp_path / "r.py").write_text("import time\ndef slow(prompt, response, **f):\n    time.sleep(60)\n")
    done = ppokit("reward", f"{tmp_path / 'r.py'}:slow", "--prompt", "p", "--response", "r", "--timeout", "1")
    assert done.returncode == 0 and done.stdout == "score: 0\nreason: timeout: timed out after 1 s\n", done.stdout
    for args, message in (
        (["nosuch", "--prompt", "p", "--response", "r"], "unknown reward function 'nosuch'; built-ins: exact_match"),
        (["math", "--prompt", "p", "--response", "r", "--field", "answer"], "KEY=VALUE"),
        (["math", "--prompt", "p"], "the following arguments are required: --response"),
    ):
        done = ppokit("reward", *args)
        assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, (
            done.stderr
        )


def test_generate_bad_inputs(run_dir, tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "neither a run directory" in capsys.readouterr().err
    assert main(["generate", str(run_dir), "--prompt", "x", "--chat-template"]) == 2
    assert "has no chat template" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # a usage error, from the parser
        main(["generate", str(run_dir), "--prompt", "x", "--top-p", "2"])
    assert usage.value.code == 2 and "argument --top-p: must be a number in (0, 1]" in capsys.readouterr().err
    torch.set_num_threads(1)
