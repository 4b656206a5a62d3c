"""The sequences of a multi-turn iteration, probed in the environment before the run starts.

The memory estimate (:func:`ppokit.lm.model.memory.multi_turn_rows`) needs, in tokens, the
first observation and what each later turn adds. Probe episodes find them:

- **legal play:** :data:`PROBE_EPISODES` episodes from seeds ``seed, seed + 1, ...`` with
  uniform random actions among ``info["legal_actions"]`` (or ``info["example_actions"]``,
  where the legal actions are not finite: a tool's calls), the learner's seat alternating
  against an environment's own opponent (``reset(options={"seat": ...})``: the second
  seat's first message holds the opponent's move); the longest first observation and the
  episode whose later observations add the most are kept;
- **invalid replies:** empty replies from the reset; where the episode goes on (the
  environment asks again, as TextArena's games do within their error allowance), a retry
  may come at any later turn: in message mode its message, in state mode the growth of a
  transcript that echoes each notice (:func:`~ppokit.lm.model.memory.state_prompt_tokens`).

State mode counts each observation as the prompt it becomes. Message mode counts what a later
observation appends to a seat's stream (:class:`~ppokit.lm.multi_turn.streams.Stream`: the
template's end of the reply, the new message and the next generation prompt), not the
observation rendered as a conversation of its own (with SmolLM2 that counted its default
system prompt again for every message).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ppokit.config import Config
from ppokit.envs import checked_reset, checked_step
from ppokit.errors import UserError
from ppokit.lm.data.chat import chat_renderer
from ppokit.lm.model.memory import IterationSizes, model_shape, multi_turn_rows, state_prompt_tokens
from ppokit.lm.model.stack import prompt_tokenizer
from ppokit.lm.multi_turn.streams import StreamCodec

__all__ = ["PROBE_EPISODES", "Probe", "iteration_sequences", "iteration_sizes", "probe_environment"]

PROBE_EPISODES = 4  # random games of tic-tac-toe last 5 to 9 moves: the longest of 4 is usually a long one
INVALID_REPLY = ""  # a reply no environment accepts as a move


@dataclass(frozen=True)
class Probe:
    """What probe episodes tell of a run's sequences, in tokens."""

    first: int  # the longest first observation, as a prompt
    later: list[int]  # the later observations of the probe episode that added the most (none: no probe)
    # an episode of invalid replies while the environment asks again: its first observation, then after each
    # retry the prompt (state mode) or what the message appends (message mode); [first] where one ends it
    retried: list[int]
    seats: int  # streams an episode trains: 2 in self-play (the environment plays no seat itself), else 1

    @property
    def retry(self) -> int | None:
        """Message mode: the most a message after an invalid reply appends (None: an invalid reply ends the episode)."""
        return max(self.retried[1:]) if len(self.retried) > 1 else None


def iteration_sizes(cfg: Config, env: Any, name: str) -> IterationSizes | None:
    """The memory estimate's sizes of an iteration: rows, P and R (:func:`iteration_sequences`)
    and, in message mode, the longest prompt a generation call takes in, the conversation so far
    (each turn prefills its stream)."""
    sequences = iteration_sequences(cfg, env, name)
    if sequences is None:
        return None
    rows, prompt, response = sequences
    prefill = prompt + response if env_mode(env) == "message" else None
    return IterationSizes(prompt, rows=rows, response_tokens=response, prefill_tokens=prefill)


def iteration_sequences(cfg: Config, env: Any, name: str) -> tuple[int, int, int] | None:
    """``(rows, P, R)`` of an iteration of ``cfg`` on ``env`` (:func:`multi_turn_rows` of its
    :func:`probe_environment`); None when its reset fails (the run reports that itself,
    ``textenv.failure_reward``)."""
    probe = probe_environment(cfg, env, name)
    if probe is None:
        return None
    message = env_mode(env) == "message"
    shape = model_shape(cfg.model.path)
    context = shape.max_positions if shape is not None else None
    R, turns = cfg.rollout.max_new_tokens, episode_turns(cfg, env)
    first = probe.first if message else state_prompt_tokens([probe.first, *probe.later], R, probe.retried, turns)
    return multi_turn_rows(
        cfg,
        first,
        message,
        context,
        env_turn_limit(env),
        later_observations=probe.later if message else None,
        retry_observation=probe.retry,
        seats=probe.seats,
    )


def env_mode(env: Any) -> str:
    """``env``'s observation mode (:attr:`ppokit.envs.TextEnv.observation_mode`; state by default)."""
    return getattr(env, "observation_mode", "state")


def env_turn_limit(env: Any) -> int | None:
    """The environment's own turn limit (``env.max_turns``), where it has one."""
    limit = getattr(env, "max_turns", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1 else None


def episode_turns(cfg: Config, env: Any) -> int:
    """An episode's turns at most: ``textenv.max_turns``, or the environment's own limit when lower."""
    return min(cfg.textenv.max_turns, env_turn_limit(env) or cfg.textenv.max_turns)


def probe_environment(cfg: Config, env: Any, name: str) -> Probe | None:
    """The module docstring's probe of ``env`` for ``cfg`` (None when its first reset fails)."""
    tokenizer = prompt_tokenizer(cfg)
    message = env_mode(env) == "message"
    turns = episode_turns(cfg, env)
    counter = _MessageCounter(cfg, tokenizer, name) if message else _PromptCounter(cfg, tokenizer)
    firsts, episodes, retried, seats, seat = [], [], [], 1, None
    for episode in range(PROBE_EPISODES):
        try:
            observation, info = _reset(env, cfg.seed + episode, seat, name)
        except UserError:
            if episode == 0:
                return None
            break
        if "player" in info and "seat" not in info:  # two seats, neither played by the environment
            seats = 2
        if "seat" in info:  # against the environment's opponent: the learner's first message differs by seat
            seat = 1 - int(info["seat"])
        try:
            firsts.append(counter.first(observation))
        except Exception:  # noqa: BLE001 - an observation the run cannot take is the run's to report
            return None
        episodes.append(_legal_episode(env, info, counter, turns - 1, cfg.seed + episode, name))
        if episode == 0:  # an environment that ends an episode on an invalid reply always does
            retried = _invalid_episode(env, counter, turns - 1, cfg.seed, name)
    return Probe(first=max(firsts), later=max(episodes, key=sum), retried=retried, seats=seats)


def _reset(env: Any, seed: int, seat: int | None, name: str) -> tuple[Any, dict]:
    """``env`` reset with ``seed``, the learner in ``seat`` where the environment takes
    ``options={"seat": ...}`` (ppokit's two-player games do), else as it chooses."""
    if seat is not None:
        try:
            return checked_reset(env, seed=seed, options={"seat": seat}, name=name)
        except UserError:
            pass
    return checked_reset(env, seed=seed, name=name)


def _legal_episode(env: Any, info: dict, counter: Any, steps: int, seed: int, name: str) -> list[int]:
    """The token counts of the observations after each of up to ``steps`` random actions among
    ``legal_actions`` (else ``example_actions``) from a reset ``env`` (``info`` is the reset's):
    none when the environment lists neither; the probe stops at the episode's end or at the
    first failing step (the run reports that itself)."""
    rng = random.Random(seed)
    counts: list[int] = []
    for _ in range(steps):
        actions = info.get("legal_actions") or info.get("example_actions")
        if not actions:
            break
        action = rng.choice(list(actions))
        try:
            result = checked_step(env, action, name=name)
            if result.terminated or result.truncated:
                break
            counts.append(counter.later(action, result.observation))
        except Exception:  # noqa: BLE001 - a failing environment or template is the run's to report
            break
        info = result.info
    return counts


def _invalid_episode(env: Any, counter: Any, steps: int, seed: int, name: str) -> list[int]:
    """The token counts of an episode of up to ``steps`` invalid replies: its first observation,
    then each one after a retry, while the environment asks again (a step with ``info["illegal"]``
    that does not end the episode); ``[]`` where the reset or a step fails."""
    try:
        observation, _ = checked_reset(env, seed=seed, name=name)
        counts = [counter.first(observation)]
        for _ in range(steps):
            result = checked_step(env, INVALID_REPLY, name=name)
            if result.terminated or result.truncated or not result.info.get("illegal"):
                break  # the episode ended, or the environment took the empty reply as a move
            counts.append(counter.later(INVALID_REPLY, result.observation))
    except Exception:  # noqa: BLE001 - a failing environment or template is the run's to report
        return []
    return counts


class _PromptCounter:
    """State mode: each observation is a prompt of its own (rendered with the chat template under
    ``data.chat_template``: SmolLM2's adds 30 tokens to each)."""

    def __init__(self, cfg: Config, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.render = chat_renderer(tokenizer, "model.path") if cfg.data.chat_template else None

    def first(self, observation: Any) -> int:
        return self.count(observation)

    def later(self, action: str, observation: Any) -> int:
        return self.count(observation)

    def count(self, observation: Any) -> int:
        text = observation if isinstance(observation, str) else " ".join(str(m) for m in observation)
        return len(self.tokenizer(self.render(observation) if self.render is not None else text)["input_ids"])


class _MessageCounter:
    """Message mode: the first observation as a stream's prompt, each later one as the tokens it
    appends to the stream after the probe's reply (the reply's tokens and a stop token)."""

    def __init__(self, cfg: Config, tokenizer: Any, name: str) -> None:
        self.tokenizer = tokenizer
        self.codec = StreamCodec(
            tokenizer,
            mode="message",
            chat=cfg.data.chat_template,
            where=f"model.path={cfg.model.path}",
            env_name=name,
        )
        self.stream = self.codec.new_stream()

    def first(self, observation: Any) -> int:
        self.stream = self.codec.new_stream()
        self.stream.observe(observation)
        return len(self.stream.ids)

    def later(self, action: str, observation: Any) -> int:
        stop = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        self.stream.act(self.codec.encode_more(action) + stop or [0])
        before = len(self.stream.ids)
        self.stream.observe(observation)
        return len(self.stream.ids) - before
