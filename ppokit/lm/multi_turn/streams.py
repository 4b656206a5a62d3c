"""Token streams of multi-turn episodes: the model's tokens as sampled, the observations appended.

Token in, token out: what the model generated is kept as the token ids it sampled, never decoded
and encoded again (a re-tokenised reply can differ from the sampled tokens, and the update's
log-probs would then be of tokens nobody sampled). Only the environment's text is tokenised.
:class:`StreamCodec` makes one :class:`Stream` per seat of an episode: ``observe(observation)``
before each turn, ``prompt()`` the tokens to generate from, ``act(action_ids)`` after it.

- ``"state"`` mode: each turn's prompt is that observation alone, tokenised as a prompt (with
  ``data.chat_template``: rendered with the generation prompt); each turn is its own batch row.
- ``"message"`` mode: the observations are appended to one stream per seat. Plain text:
  ``tok(obs_0) + action_0 + tok(obs_1, no special tokens) + action_1 + ...``. Chat template: the
  tokens appended before turn k are what the template writes after its rendering of turn k-1's
  reply, so the stream equals the template applied to the whole conversation; a template that
  is not append-only raises :class:`~ppokit.errors.UserError`.

The model's tokens are a stream's *action* tokens (:attr:`Stream.action_spans`); everything else
is environment tokens, with mask 0 in the batch. Details: docs/multiturn.md, "Token in, token out".
"""

from __future__ import annotations

from typing import Any

from ppokit.envs.checks import EnvError
from ppokit.errors import UserError
from ppokit.lm.data.chat import apply_template, as_messages, encoder_adds_bos

__all__ = ["Stream", "StreamCodec"]

MODES = ("state", "message")


def messages_without_template(env_name: str) -> str:
    """The error of an environment whose observations are chat messages in a run without a chat template."""
    return (
        f"environment '{env_name}' gave chat messages as the observation, but data.chat_template "
        "is false; set data.chat_template=true (a model with a chat template), or return text"
    )


class StreamCodec:
    """Tokenises observations for one run: ``tokenizer``, ``mode`` (state | message), ``chat``
    (``data.chat_template``); ``where`` names the model and ``env_name`` the environment in errors."""

    def __init__(
        self,
        tokenizer,
        *,
        mode: str,
        chat: bool,
        where: str = "the model",
        env_name: str = "the environment",
        stop_ids: list[int] | None = None,
    ):
        if mode not in MODES:
            raise UserError(
                f"environment '{env_name}': observation_mode must be one of {', '.join(MODES)} (got {mode!r})"
            )
        if chat and not getattr(tokenizer, "chat_template", None):
            raise UserError(
                f"data.chat_template=true, but the tokenizer of {where} has no chat template; use a chat "
                "model, or set data.chat_template=false"
            )
        self.tokenizer, self.mode, self.chat, self.where, self.env_name = tokenizer, mode, chat, where, env_name
        self.stop_ids = set(stop_ids if stop_ids is not None else [tokenizer.eos_token_id])
        self.strip_bos = encoder_adds_bos(tokenizer) if chat else False

    def new_stream(self) -> Stream:
        return Stream(self)

    # ------------------------------------------------------------------ pieces
    def text_of(self, observation: Any) -> str:
        """A plain-text observation; chat messages without a chat template are an error."""
        if isinstance(observation, str):
            return observation
        raise EnvError(messages_without_template(self.env_name))

    def render(self, messages: list[dict[str, Any]]) -> str:
        return apply_template(
            self.tokenizer,
            messages,
            strip_bos=self.strip_bos,
            generation_prompt=True,
            where=self.where,
            prompt=messages[-1].get("content") if messages else "",
        )

    def encode_prompt(self, text: str) -> list[int]:
        """A stream's first tokens (the encoder's BOS included, as for any prompt)."""
        return list(self.tokenizer(text)["input_ids"])

    def encode_more(self, text: str) -> list[int]:
        """Tokens appended after the model's: no special tokens added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def decode(self, ids: list[int], keep_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not keep_special, clean_up_tokenization_spaces=False)


class Stream:
    """One seat's tokens in one episode (see the module docstring).

    ``ids``: the stream (message mode) or the current turn's prompt followed by its
    action (state mode). ``action_spans``: ``(start, end)`` of each action in ``ids``
    (message mode; state mode keeps only the current turn). ``first_prompt_length``:
    the tokens of the first observation. ``action_tokens``: the model's tokens so far.
    """

    def __init__(self, codec: StreamCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.action_spans: list[tuple[int, int]] = []
        self.first_prompt_length = 0
        self.action_tokens = 0
        self.turns = 0
        self._messages: list[dict[str, Any]] = []
        self._rendered = ""  # chat: the template's text of the conversation up to the last observation
        self._last_action: list[int] | None = None
        self._pending = False  # an observation was given and not yet acted on

    @property
    def started(self) -> bool:
        return bool(self.ids)

    def observe(self, observation: Any) -> None:
        """Take the observation that comes before this seat's next action."""
        c = self.codec
        if c.mode == "state":
            if c.chat:
                text = c.render(as_messages(observation))
            else:
                text = c.text_of(observation)
            self.ids = c.encode_prompt(text)
            self.action_spans = []
            if not self.turns:
                self.first_prompt_length = len(self.ids)
        elif not self.started:
            if c.chat:
                self._messages = as_messages(observation)
                self._rendered = c.render(self._messages)
                self.ids = c.encode_prompt(self._rendered)
            else:
                self.ids = c.encode_prompt(c.text_of(observation))
            self.first_prompt_length = len(self.ids)
        else:
            if self._pending:
                raise RuntimeError("two observations in a row without an action between them")
            self.ids = self.ids + self._delta(observation)
        self._pending = True

    def prompt(self) -> list[int]:
        """The tokens the next action is generated from."""
        if not self._pending:
            raise RuntimeError("no observation to act on: call observe() first")
        return list(self.ids)

    def act(self, action_ids: list[int]) -> None:
        """Append the model's tokens for this turn, exactly as sampled (up to and including the stop token)."""
        if not self._pending:
            raise RuntimeError("act() without an observation")
        if not action_ids:
            raise ValueError("an action has at least one token")
        start = len(self.ids)
        self.ids = self.ids + list(action_ids)
        self.action_spans.append((start, len(self.ids)))
        self.action_tokens += len(action_ids)
        self.turns += 1
        self._last_action = list(action_ids)
        self._pending = False

    @property
    def episode_tokens(self) -> int:
        """The budget's count: the model's tokens, plus (message mode) the observation tokens
        appended after the first observation."""
        if self.codec.mode == "state":
            return self.action_tokens
        return len(self.ids) - self.first_prompt_length

    # ------------------------------------------------------------------ message mode
    def _delta(self, observation: Any) -> list[int]:
        c = self.codec
        if not c.chat:
            return c.encode_more(c.text_of(observation))
        action = self._last_action or []
        content = c.decode(
            [t for t in action if t not in c.stop_ids] if action and action[-1] in c.stop_ids else action,
            keep_special=False,
        )
        as_sampled = c.decode(action, keep_special=True)
        messages = self._messages + [{"role": "assistant", "content": content}] + as_messages(observation)
        rendered = c.render(messages)
        turn = self.turns
        if not rendered.startswith(self._rendered):
            raise UserError(
                f"the chat template of {c.where} is not append-only: its rendering of the conversation "
                f"after turn {turn} does not start with its rendering before it (it rewrites earlier "
                "messages), so a multi-turn token stream cannot keep the model's tokens; use a template "
                "that only appends, or an environment with observation_mode='state'"
            )
        rest = rendered[len(self._rendered) :]
        if rest.startswith(as_sampled):
            tail = rest[len(as_sampled) :]
        elif action and action[-1] in c.stop_ids and rest.startswith(content):
            tail = rest[len(content) :]  # the template ends the turn with its own text
        else:
            raise UserError(
                f"the chat template of {c.where} does not write the model's reply of turn {turn} as the "
                f"model wrote it ({as_sampled[:40]!r} became {rest[:40]!r}), so a multi-turn token "
                "stream cannot keep the model's tokens; use a template that writes the assistant's "
                "content unchanged, or an environment with observation_mode='state'"
            )
        self._messages, self._rendered = messages, rendered
        return c.encode_more(tail)
