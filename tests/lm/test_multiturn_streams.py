"""Multi-turn token streams: the model's tokens kept as sampled, observations appended, masks across turns.

The "model" here is scripted: its actions are token ids chosen by the test (some the
tokenizer's own encoding of a reply, some not), so every expectation is exact.
"""

from __future__ import annotations

import pytest
import torch

from ppokit.envs.checks import EnvError
from ppokit.errors import UserError
from ppokit.lm.model.hf import load_tokenizer
from ppokit.lm.multi_turn.episodes import Trajectory, TurnData
from ppokit.lm.multi_turn.streams import StreamCodec
from ppokit.lm.multi_turn.turn_batch import trajectory_tensors

# ChatML-like, in the tiny alphabet: every turn ends with the EOS token, then a newline the
# model never generates (as ChatML's "<|im_end|>\n").
ENDS_WITH_EOS = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
# Ends a turn with a newline of its own: the model's EOS is not in the rendered text.
ENDS_WITH_NEWLINE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
# Drops the assistant's replies from the rendering (as templates that drop earlier reasoning do): not append-only.
FORGETFUL = (
    "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['role'][0] }}:"
    "{{ m['content'] }}<eos>\n{% endif %}{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)
# Rewrites the assistant's content (upper-case letters are not even in the alphabet: stripped here).
STRIPPING = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] | trim }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


def with_template(tok, template):
    tok = load_tokenizer(tok.name_or_path)
    tok.chat_template = template
    return tok


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def play(stream, observations, actions):
    """observe / act alternately; returns the prompt of each turn."""
    prompts = []
    for obs, action in zip(observations, actions):
        stream.observe(obs)
        prompts.append(stream.prompt())
        stream.act(action)
    return prompts


# ----------------------------------------------------------------------------- plain text
def test_plain_message_stream_is_the_concatenation_of_observation_and_sampled_tokens(tok):
    codec = StreamCodec(tok, mode="message", chat=False)
    s = codec.new_stream()
    eos = tok.eos_token_id
    # the second action is not the tokenizer's own encoding of anything (a stray EOS inside): kept as is
    actions = [ids(tok, "go 3") + [eos], [ids(tok, "x")[0], eos, ids(tok, "y")[0]], ids(tok, "done") + [eos]]
    observations = ["start?", "\nok, again:", "\nlast:"]
    prompts = play(s, observations, actions)
    want = tok("start?")["input_ids"]
    assert prompts[0] == want and want[0] == tok.bos_token_id
    for k in range(1, 3):
        want = want + actions[k - 1] + ids(tok, observations[k])
        assert prompts[k] == want
    assert s.ids == want + actions[2]
    assert [s.ids[a:b] for a, b in s.action_spans] == actions
    assert s.episode_tokens == len(s.ids) - len(tok("start?")["input_ids"])


def test_messages_without_a_chat_template_are_a_one_line_error(tok):
    s = StreamCodec(tok, mode="message", chat=False, env_name="calc").new_stream()
    with pytest.raises(EnvError, match=r"environment 'calc' gave chat messages .* set data.chat_template=true"):
        s.observe([{"role": "user", "content": "hi"}])


def test_state_mode_prompts_are_each_observation_alone(tok):
    codec = StreamCodec(tok, mode="state", chat=False)
    s = codec.new_stream()
    eos = tok.eos_token_id
    prompts = play(s, ["123\nx to move:", "1o3\nx to move:"], [ids(tok, "5") + [eos], ids(tok, "1") + [eos]])
    assert prompts == [tok("123\nx to move:")["input_ids"], tok("1o3\nx to move:")["input_ids"]]
    assert s.episode_tokens == 4 and s.turns == 2


# ----------------------------------------------------------------------------- chat templates
def conversation(observations, replies):
    messages = []
    for obs, reply in zip(observations, replies):
        messages += [{"role": "user", "content": obs}] if isinstance(obs, str) else obs
        if reply is not None:
            messages.append({"role": "assistant", "content": reply})
    return messages


def test_chat_stream_equals_the_template_applied_to_the_whole_conversation(tok):
    tok = with_template(tok, ENDS_WITH_EOS)
    codec = StreamCodec(tok, mode="message", chat=True)
    s = codec.new_stream()
    eos = tok.eos_token_id
    replies = ["calc: 3*4", "answer: 12"]
    observations = [
        [{"role": "system", "content": "solve"}, {"role": "user", "content": "3 bags of 4?"}],
        [{"role": "tool", "content": "12"}],
    ]
    prompts = play(s, observations, [ids(tok, r) + [eos] for r in replies])
    for k in range(2):
        # the prompt of turn k: the template on the conversation so far, with the generation prompt
        text = tok.apply_chat_template(
            conversation(observations[: k + 1], replies[:k] + [None]), tokenize=False, add_generation_prompt=True
        )
        assert prompts[k] == tok(text)["input_ids"]
    # the template's newline after the model's EOS is an environment token (mask 0), never generated
    a0_end = s.action_spans[0][1]
    assert s.ids[a0_end - 1] == eos and s.ids[a0_end] == ids(tok, "\n")[0]


def test_a_template_that_ends_turns_with_its_own_text_keeps_the_sampled_eos(tok):
    tok = with_template(tok, ENDS_WITH_NEWLINE)
    s = StreamCodec(tok, mode="message", chat=True).new_stream()
    eos = tok.eos_token_id
    prompts = play(s, ["2+2?", "and 3+3?"], [ids(tok, "4") + [eos], ids(tok, "6") + [eos]])
    # "u:2+2?\na:" + 4 <eos> + "\nu:and 3+3?\na:": the template's text with the model's EOS where it stopped
    assert prompts[1] == tok("u:2+2?\na:")["input_ids"] + ids(tok, "4") + [eos] + ids(tok, "\nu:and 3+3?\na:")


def test_a_reply_cut_by_max_new_tokens_gets_the_templates_end_of_turn(tok):
    tok = with_template(tok, ENDS_WITH_EOS)
    s = StreamCodec(tok, mode="message", chat=True).new_stream()
    prompts = play(s, ["count:", "more:"], [ids(tok, "123"), ids(tok, "4")])  # no EOS: truncated replies
    text = tok.apply_chat_template(
        conversation(["count:", "more:"], ["123", None]), tokenize=False, add_generation_prompt=True
    )
    assert prompts[1] == tok(text)["input_ids"]
    a0_end = s.action_spans[0][1]
    assert s.ids[a0_end] == tok.eos_token_id  # the template's end-of-turn token: environment side


def test_a_template_that_is_not_append_only_is_a_clear_error(tok):
    s = StreamCodec(with_template(tok, FORGETFUL), mode="message", chat=True, where="model.path=m").new_stream()
    s.observe("hi")
    s.act(ids(tok, "yo") + [tok.eos_token_id])
    with pytest.raises(UserError, match=r"^the chat template of model.path=m is not append-only: .* after turn 1 "):
        s.observe("again")  # its rendering drops the reply "yo"


def test_a_template_that_rewrites_the_reply_is_a_clear_error(tok):
    s = StreamCodec(with_template(tok, STRIPPING), mode="message", chat=True, where="model.path=m").new_stream()
    s.observe("hi")
    s.act(ids(tok, " yo ") + [tok.eos_token_id])
    with pytest.raises(UserError, match=r"does not write the model's reply of turn 1 as the model wrote it"):
        s.observe("again")


def test_state_mode_with_a_chat_template_renders_each_observation(tok):
    tok = with_template(tok, ENDS_WITH_EOS)
    s = StreamCodec(tok, mode="state", chat=True).new_stream()
    s.observe("123\nx to move:")
    assert s.prompt() == tok("u:123\nx to move:<eos>\na:")["input_ids"]


# ----------------------------------------------------------------------------- masks across turns
def test_masks_across_turns_in_message_mode(tok):
    tok = with_template(tok, ENDS_WITH_EOS)
    codec = StreamCodec(tok, mode="message", chat=True)
    eos = tok.eos_token_id
    s = codec.new_stream()
    actions = [ids(tok, "a1") + [eos], ids(tok, "b") + [eos], ids(tok, "c33") + [eos]]
    prompts = play(s, ["p", "q", "r"], actions)
    traj = Trajectory(0, None, s, [TurnData(p, a, r) for p, a, r in zip(prompts, actions, [0.5, -1.0, 2.0])])
    other = codec.new_stream()  # a second, shorter trajectory (padding on both sides)
    p2 = play(other, ["long first observation"], [ids(tok, "z") + [eos]])
    traj2 = Trajectory(1, None, other, [TurnData(p2[0], ids(tok, "z") + [eos], 1.0)], truncated=True)
    t, extras = trajectory_tensors([traj, traj2], mode="message", pad_id=tok.pad_token_id)
    P = t["input_ids"].shape[1] - t["responses"].shape[1]
    first = s.first_prompt_length
    row = t["input_ids"][0, P - first :].tolist()
    assert row[: len(s.ids)] == s.ids  # the whole stream, left-padded prompt + response region
    mask, turn, scores = t["mask"][0], t["turn_index"][0], t["token_scores"][0]
    for k, (a, b) in enumerate(s.action_spans):
        assert mask[a - first : b - first].tolist() == [1.0] * (b - a)
        assert turn[a - first : b - first].tolist() == [k] * (b - a)
        assert scores[b - first - 1].item() == [0.5, -1.0, 2.0][k]
    assert mask.sum().item() == sum(len(a) for a in actions)  # nothing else: observations are 0
    assert t["attention_mask"][0, P:].sum().item() == len(s.ids) - first  # but the model reads them
    assert t["turn_index"][0][mask == 0].eq(-1).all() and scores[mask == 0].eq(0).all()
    assert t["traj_index"].tolist() == [0, 1]
    assert extras["traj_truncated"].tolist() == [False, True]
    assert torch.equal(t["position_ids"][1, P - len(p2[0]) : P + 2], torch.arange(len(p2[0]) + 2))


def test_masks_across_turns_in_state_mode_are_one_row_per_turn(tok):
    codec = StreamCodec(tok, mode="state", chat=False)
    eos = tok.eos_token_id
    s = codec.new_stream()
    actions = [ids(tok, "5") + [eos], ids(tok, "12")]  # the second one cut without EOS
    prompts = play(s, ["123\nx:", "1o3\nx:"], actions)
    traj = Trajectory(
        0,
        0,
        s,
        [TurnData(p, a, r) for p, a, r in zip(prompts, actions, [0.0, 1.0])],
        truncated=True,
        bootstrap_ids=tok("xo3\nx:")["input_ids"],
    )
    t, extras = trajectory_tensors([traj], mode="state", pad_id=tok.pad_token_id)
    assert t["traj_index"].tolist() == [0, 0]
    assert t["mask"].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert t["turn_index"].tolist() == [[0, 0], [1, 1]]
    assert t["token_scores"].tolist() == [[0.0, 0.0], [0.0, 1.0]]
    assert t["responses"].tolist() == actions
    assert extras["bootstrap_traj"].tolist() == [0]
    assert extras["bootstrap_input_ids"][0].tolist() == tok("xo3\nx:")["input_ids"]
