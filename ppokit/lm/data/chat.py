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

from collections.abc import Callable, Sequence
from typing import Any

from ppokit.errors import UserError

ROLES_HINT = 'a list of {"role": "...", "content": "..."} messages'


def message_problem(value: Any) -> str | None:
    """Why ``value`` is not a non-empty list of chat messages, or None if it is one."""
    if not isinstance(value, list) or not value:
        return f"expected {ROLES_HINT}"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return (
                f"message {i} is a {type(message).__name__}, expected an object like "
                '{"role": "user", "content": "..."}'
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str) or not message[key]:
                return f'message {i} needs a non-empty string "{key}" (got {message.get(key)!r})'
    return None


def chat_renderer(tokenizer, where: str) -> Callable[[Any], str]:
    """``render(prompt) -> text`` with ``tokenizer``'s chat template (``where`` names the
    model in errors); a tokenizer without a template is a :class:`UserError`."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"data.chat_template=true, but the tokenizer of {where} has no chat template "
            "(no chat_template in its tokenizer_config.json or chat_template.jinja); use a chat "
            "model, or set data.chat_template=false and write the prompts as plain text"
        )
    strip_bos = encoder_adds_bos(tokenizer)

    def render(prompt: Any) -> str:
        return apply_template(
            tokenizer, as_messages(prompt), strip_bos=strip_bos, generation_prompt=True, where=where, prompt=prompt
        )

    return render


def model_chat_renderer(model: str, *, what: str, option: str, fix: str) -> Callable[[Any], str]:
    """:func:`chat_renderer` with the tokenizer of the model directory ``model`` (``what``
    names the setting that gave it, ``option`` the one that asked for a template, ``fix``
    what to do when ``model`` is the built-in tiny model, which has no template)."""
    if model == "tiny":
        raise UserError(f"{option} needs a model with a chat template, and the built-in tiny model has none; {fix}")
    # heavy (transformers): reading prompts and records, this module's other users, stays light
    from ppokit.lm.model.hf import load_tokenizer  # noqa: PLC0415

    return chat_renderer(load_tokenizer(model, what), f"{what}={model}")


def as_messages(prompt: Any) -> list[dict[str, Any]]:
    """A prompt as chat messages: a string is one user message, a message list a copy of itself."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def encoder_adds_bos(tokenizer) -> bool:
    """Whether encoding a text puts a BOS token in front of it."""
    return bool(tokenizer.bos_token) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]


def apply_template(
    tokenizer, messages: list[dict[str, Any]], *, strip_bos: bool, generation_prompt: bool, where: str, prompt: Any
) -> str:
    """``messages`` as text in ``tokenizer``'s chat template; with ``strip_bos`` (the encoder adds
    one: :func:`encoder_adds_bos`) a leading BOS is dropped, so that encoding gives exactly one.
    A template that rejects the messages is a UserError naming ``where`` and ``prompt``."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja errors: the template rejects these messages
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"the chat template of {where} failed on the prompt {prompt!r}: {first}") from None
    bos = tokenizer.bos_token
    return text[len(bos) :] if strip_bos and text.startswith(bos) else text


# A record's prompt as written (string or messages), kept beside the rendered one for a
# reward model with a chat template of its own (ppokit.lm.rewards.reward_model); never a reward field.
RAW_PROMPT = "_ppokit_raw_prompt"


def render_records(records: Sequence[dict[str, Any]], render: Callable[[Any], str]) -> list[dict[str, Any]]:
    """Copies of ``records`` whose ``"prompt"`` is the rendered text (the prompt as written kept
    under :data:`RAW_PROMPT`; other fields unchanged)."""
    return [{**record, "prompt": render(record["prompt"]), RAW_PROMPT: record["prompt"]} for record in records]
