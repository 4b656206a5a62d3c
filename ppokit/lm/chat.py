"""Chat-formatted prompts: rendered once, with the tokenizer's own chat template.

With ``data.chat_template: true`` every prompt record is rendered before anything else
sees it. A prompt is either a string (one user message) or, in a JSONL file, a list of
messages ``[{"role": "system", "content": "..."}, {"role": "user", "content": "..."}]``::

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

Generation, scoring, evaluation and the supervised warm start then work on ``text`` (an
SFT record's ``completion`` follows it as the assistant's answer), and the reward
function receives it as ``prompt``. Without ``data.chat_template`` a prompt must be a
string and is used as it is.

Templates that write the BOS token themselves (Llama 3's) meet tokenizers that also add
one when they encode: the prompt would start with two. Where the tokenizer adds a BOS, a
leading BOS in the rendered text is dropped, so that encoding gives exactly one.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ppokit.errors import UserError

ROLES_HINT = 'a list of {"role": "...", "content": "..."} messages'


def message_problem(value: Any) -> str | None:
    """Why ``value`` is not a non-empty list of chat messages, or None if it is one."""
    if not isinstance(value, list) or not value:
        return f"expected {ROLES_HINT}"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} is a {type(message).__name__}, expected an object like " \
                   '{"role": "user", "content": "..."}'
        for key in ("role", "content"):
            if not isinstance(message.get(key), str) or not message[key]:
                return f"message {i} needs a non-empty string \"{key}\" (got {message.get(key)!r})"
    return None


def chat_renderer(tokenizer, where: str) -> Callable[[Any], str]:
    """``render(prompt) -> text`` with ``tokenizer``'s chat template (``where`` names the
    model in errors); a tokenizer without a template is a :class:`UserError`."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"data.chat_template=true, but the tokenizer of {where} has no chat template "
                        "(no chat_template in its tokenizer_config.json or chat_template.jinja); use a chat "
                        "model, or set data.chat_template=false and write the prompts as plain text")
    bos = tokenizer.bos_token
    adds_bos = bool(bos) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]

    def render(prompt: Any) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:      # jinja errors: the template rejects these messages
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(f"the chat template of {where} failed on the prompt {prompt!r}: {first}") from None
        if adds_bos and text.startswith(bos):
            text = text[len(bos):]      # the encoder adds it back: exactly one BOS
        return text

    return render


# A record's prompt as written (string or messages), kept beside the rendered one for a
# reward model with a chat template of its own (ppokit.lm.reward_model); never a reward field.
RAW_PROMPT = "_ppokit_raw_prompt"


def render_records(records: Sequence[dict[str, Any]], render: Callable[[Any], str]) -> list[dict[str, Any]]:
    """Copies of ``records`` whose ``"prompt"`` is the rendered text (the prompt as written kept
    under :data:`RAW_PROMPT`; other fields unchanged)."""
    return [{**record, "prompt": render(record["prompt"]), RAW_PROMPT: record["prompt"]} for record in records]
