"""Chat-formatted prompts (``data.chat_template``): rendering, data files, and a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lm_helpers import CHAT_TEMPLATE as TEMPLATE

from ppokit.cli import main
from ppokit.config import build_config
from ppokit.errors import UserError
from ppokit.lm.data.chat import chat_renderer
from ppokit.lm.data.sources import load_prompts
from ppokit.lm.model.hf import load_tokenizer
from ppokit.persistence.rundir import read_metrics


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_string_prompt_is_one_user_message_and_encodes_with_one_bos(chat_dir):
    tok = load_tokenizer(chat_dir)
    render = chat_renderer(tok, "the test model")
    text = render("12+3=")
    assert text == "u:12+3=\na:"  # the template's own BOS dropped: the encoder adds one
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_a_message_list_keeps_its_roles(chat_dir, tmp_path):
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="}]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": messages, "answer": "2"}])
    [record] = load_prompts(str(path), chat=True)
    assert record["prompt"] == messages and record["answer"] == "2"
    assert chat_renderer(load_tokenizer(chat_dir), "m")(record["prompt"]) == "s:add\nu:1+1=\na:"


def test_a_message_list_without_chat_template_names_the_line_and_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1="}, {"prompt": [{"role": "user", "content": "x"}]}])
    with pytest.raises(
        UserError,
        match=r"p.jsonl line 2: \"prompt\" is a list of chat messages; set "
        r"data.chat_template=true",
    ) as info:
        load_prompts(str(path))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "prompt, problem",
    [
        ([], "expected a list of"),
        (["hi"], "message 0 is a str"),
        ([{"role": "user"}], 'message 0 needs a non-empty string "content"'),
        ([{"role": "user", "content": "a"}, {"role": "", "content": "b"}], 'message 1 needs a non-empty string "role"'),
    ],
)
def test_malformed_messages_are_named(tmp_path, prompt, problem):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": prompt}])
    with pytest.raises(UserError, match='p.jsonl line 1: "prompt": ' + problem):
        load_prompts(str(path), chat=True)


def test_a_model_without_a_chat_template_is_a_clear_error(tiny_dir):
    from ppokit.lm.inputs import load_data

    cfg = build_config(
        [
            {
                "workload": "lm",
                "model": {"path": str(tiny_dir)},
                "data": {"chat_template": True},
                "train": {"iterations": 1},
            }
        ]
    )
    with pytest.raises(
        UserError,
        match=r"data.chat_template=true, but the tokenizer of model.path=.* has no chat "
        "template",
    ):
        load_data(cfg)
    tiny = build_config(
        [{"workload": "lm", "model": {"path": "tiny"}, "data": {"chat_template": True}, "train": {"iterations": 1}}]
    )
    with pytest.raises(UserError, match="the built-in tiny model has none"):
        load_data(tiny)


def test_a_chat_run_trains_evaluates_and_rewards_on_the_rendered_prompt(chat_dir, tmp_path, capsys):
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="}]
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": messages, "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    )
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": "3+3=", "answer": "6"}])
    # reward 1 when the prompt it is given is the rendered one (the generation prompt "a:" last)
    (tmp_path / "seen.py").write_text(
        "def rendered(prompt, response, **fields):\n"
        "    return float(prompt.endswith('\\na:') and '<bos>' not in prompt)\n"
    )
    args = [
        "train",
        "arith",
        f"model.path={chat_dir}",
        f"data.prompts={train}",
        f"data.eval_prompts={held}",
        f"data.reward={tmp_path / 'seen.py'}:rendered",
        "data.chat_template=true",
        "data.sft_epochs=0",
        "data.eval_size=1",
        "train.iterations=2",
        "train.batch_size=8",
        "train.mini_batch_size=8",
        "train.micro_batch_size=8",
        "algo.group_size=4",
        "rollout.max_new_tokens=2",
        "run.precision=fp32",
        "run.tensorboard=false",
        "--output-dir",
        str(tmp_path),
        "--name",
        "run",
        "--no-progress",
    ]
    assert main(args) == 0
    rows = read_metrics(tmp_path / "run")
    assert [r["reward_mean"] for r in rows] == [1.0, 1.0]
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--json"]) == 0  # renders with the checkpoint's tokenizer
    result = json.loads(capsys.readouterr().out)
    assert result["prompts"] == 1 and result["mean_reward"] == 1.0 and result["pass@1_greedy"] == 1.0


def test_the_warm_start_trains_on_rendered_prompts(chat_dir, tmp_path, monkeypatch):
    from ppokit.lm import base_model

    records = [
        {"prompt": [{"role": "user", "content": "1+1="}], "completion": "2"},
        {"prompt": "2+2=", "completion": "4"},
    ]
    train = write_jsonl(tmp_path / "sft.jsonl", records)
    cfg = build_config(
        [
            {
                "workload": "lm",
                "model": {"path": str(chat_dir)},
                "data": {
                    "prompts": str(train),
                    "reward": "exact_match",
                    "chat_template": True,
                    "sft_epochs": 1,
                    "sft_examples": 2,
                },
                "train": {"iterations": 1},
            }
        ]
    )
    seen = {}

    def fake_sft(model_dir, out_dir, examples, eval_set, settings, **kwargs):
        seen["examples"] = examples
        raise KeyboardInterrupt  # stop here: only the examples are checked

    monkeypatch.setattr(base_model, "run_sft", fake_sft)
    with pytest.raises(KeyboardInterrupt):
        base_model.prepare_model(cfg, tmp_path / "run", [{"prompt": "u:3+3=\na:", "answer": "6"}], None, print)
    assert [(e["prompt"], e["completion"]) for e in seen["examples"]] == [("u:1+1=\na:", "2"), ("u:2+2=\na:", "4")]


def test_ppokit_sft_renders_with_chat_template(chat_dir, tmp_path, capsys):
    records = [
        {"prompt": [{"role": "user", "content": "1+1="}], "completion": "2", "answer": "2"},
        {"prompt": "2+2=", "completion": "4", "answer": "4"},
    ]
    train = write_jsonl(tmp_path / "sft.jsonl", records)
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": "3+3=", "answer": "6"}])
    base = [
        "sft",
        str(train),
        "--eval-prompts",
        str(held),
        "--reward",
        "exact_match",
        "--epochs-max",
        "1",
        "--precision",
        "fp32",
    ]
    assert main([*base, "--model", str(chat_dir), "--out", str(tmp_path / "no")]) == 2
    assert "--chat-template" in capsys.readouterr().err  # a message list needs the option
    assert main([*base, "--model", str(chat_dir), "--out", str(tmp_path / "out"), "--chat-template"]) == 0
    assert load_tokenizer(tmp_path / "out").chat_template == TEMPLATE
    assert main([*base, "--out", str(tmp_path / "tiny"), "--chat-template"]) == 2
    assert "the built-in tiny model has none" in capsys.readouterr().err
