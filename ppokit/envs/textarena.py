"""TextArena games as ppokit text environments: ``textenv.env: textarena:<id>``.

:class:`TextArenaEnv` plays any one- or two-player game of `TextArena
<https://github.com/LeonGuertler/TextArena>`_ (``pip install 'ppokit[textarena]'``) through
ppokit's text-environment API (:mod:`ppokit.envs.base`). :func:`textarena_factory` is what
:func:`ppokit.envs.make_env` calls; :func:`game_ids` and ``python -m ppokit.envs.textarena`` list
the ids; :func:`clean_action` turns a reply into the move the game gets (by default its last
``[...]``); :data:`STATE_MOVES` reads four games' legal moves from their state (other games: the
list the game printed); :data:`REFUSED` names the games that need the network or an API key.

The game is built without the id's wrappers: ppokit renders the observations itself (the whole
transcript, or ``view="board"`` as TextArena's ``-train`` variants show it), and TextArena's
observation wrappers keep their history across ``reset``. Every reset builds a new game object,
and every call into TextArena runs with this environment's own state of Python's global
``random`` swapped in, so environments stepped in turn do not disturb each other. Observations,
actions, rewards, invalid moves (TextArena's ``error_allowance``), seats and opponents:
docs/environments.md, "TextArena games".
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import importlib.util
import inspect
import random
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ppokit.errors import UserError

from .base import TextEnv
from .checks import EnvError, one_line_error

__all__ = [
    "INSTALL",
    "PREFIX",
    "REFUSED",
    "TextArenaEnv",
    "clean_action",
    "game_ids",
    "textarena_factory",
]

PREFIX = "textarena:"
INSTALL = "pip install 'ppokit[textarena]'"
LIST_COMMAND = "python -m ppokit.envs.textarena"
VARIANT_SUFFIXES = ("-raw", "-train")  # the same game with other (or no) TextArena wrappers
OPPONENTS = ("random", "self")
ACTION_FORMATS = ("last_bracket", "raw")
VIEWS = ("history", "board")
MAX_OPPONENT_MOVES = 1000  # per learner step: a game that never hands the turn back is a bug

_NLTK = "needs the network: it downloads NLTK corpora (nltk.download) when it is built"
_OPENROUTER = "needs the network and an API key: it asks OpenRouter models (OPENROUTER_API_KEY)"
# game family (the package under textarena.envs) -> why ppokit refuses it (it plays games offline)
REFUSED: dict[str, str] = {
    **dict.fromkeys(
        (
            "Codenames",
            "DontSayIt",
            "Hangman",
            "LetterAuction",
            "SpellingBee",
            "WordChains",
            "WordLadder",
            "WordSearch",
            "Wordle",
        ),
        _NLTK,
    ),
    **dict.fromkeys(("Debate", "GuessWho", "ScenarioPlanning", "TwentyQuestions"), _OPENROUTER),
}

_BRACKETED = re.compile(r"\[[^\[\]\n]*\]")
_TEMPLATE = re.compile(r"(?<![\w-])[A-Z](?![\w-])")  # the X of "[bet X]", but not "[A4]" or "[N1C2B1A1]"
_LISTING = re.compile(r"(?:available|valid|legal|possible)\s+(?:moves|actions)(?:\s+are)?\s*:", re.IGNORECASE)


# ----------------------------------------------------------------------------- names
def _import_textarena(spec: str) -> Any:
    """The ``textarena`` module, or the one-line error that says how to install it."""
    if importlib.util.find_spec("textarena") is None:
        raise EnvError(f"textenv.env={spec}: needs the optional package: {INSTALL}")
    try:
        return importlib.import_module("textarena")
    except Exception as exc:  # noqa: BLE001 - a broken install: say so on one line
        raise EnvError(f"textenv.env={spec}: importing textarena failed: {one_line_error(exc)}") from None


def _registry(spec: str) -> dict[str, Any]:
    return _import_textarena(spec).envs.registration.ENV_REGISTRY


def game_ids(include_variants: bool = False) -> list[str]:
    """TextArena's game ids, sorted (without the ``-raw`` / ``-train`` variants unless asked)."""
    ids = _registry(PREFIX + "...")
    return sorted(i for i in ids if include_variants or not i.endswith(VARIANT_SUFFIXES))


def _did_you_mean(env_id: str, ids: Sequence[str]) -> str:
    lowered = {i.lower(): i for i in ids}
    match = difflib.get_close_matches(env_id.lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean '{PREFIX}{lowered[match[0]]}'?" if match else ""


def registered_game(env_id: str) -> tuple[str, Callable[..., Any], dict[str, Any]]:
    """A game ppokit can play offline: its family (``Wordle`` for ``Wordle-v0-hardcore``), its class
    (imported) and its registry entry's keyword arguments. TextArena not installed, an unknown id
    (with the closest playable one), a refused game (:data:`REFUSED`) or a game whose module does
    not import is a one-line :class:`EnvError`."""
    name = PREFIX + env_id
    ids = _registry(name)
    if env_id not in ids:
        playable = [i for i in ids if _family(ids[i].entry_point) not in REFUSED]
        raise EnvError(
            f"unknown TextArena game '{name}'{_did_you_mean(env_id, playable) or ';'} list the ids with: {LIST_COMMAND}"
        )
    registered = ids[env_id]
    family = _family(registered.entry_point)
    if family in REFUSED:
        raise EnvError(f"{name} {REFUSED[family]}; ppokit plays only games that run offline")
    entry = registered.entry_point
    try:
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - TextArena's own module
        raise EnvError(f"{name}: TextArena's code for this game does not import here: {one_line_error(exc)}") from None
    return family, entry, dict(registered.kwargs)


def textarena_factory(spec: str) -> Callable[..., TextArenaEnv]:
    """The factory :func:`ppokit.envs.make_env` calls for ``"textarena:<id>"``, the game checked
    (:func:`registered_game`), so that the check before a run's start says what is wrong without
    importing the model's modules."""
    env_id = spec.strip()[len(PREFIX) :].strip()
    registered_game(env_id)
    return functools.partial(TextArenaEnv, env_id)


def _family(entry_point: Any) -> str:
    """``Wordle`` for ``textarena.envs.Wordle.env:WordleEnv`` (or a class defined there)."""
    module = entry_point.partition(":")[0] if isinstance(entry_point, str) else entry_point.__module__
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["textarena", "envs"] else module


# ----------------------------------------------------------------------------- actions
def clean_action(text: str, action_format: str = "last_bracket") -> str:
    """The move passed to the game: the last ``[...]`` of ``text`` (a model that reasons before it
    answers names moves on the way), or ``text`` stripped and put in brackets when it has none
    (``"last_bracket"``); ``text`` unchanged (``"raw"``)."""
    if action_format == "raw":
        return text
    moves = _BRACKETED.findall(text)
    return moves[-1] if moves else f"[{text.strip()}]"


def _listed_moves(text: str) -> list[str] | None:
    """The bracketed moves after the last "Available Moves:" (valid/legal/possible moves or
    actions) in ``text``, up to the end of that line, without templates such as ``[bet X]``
    (a lone capital letter stands for a value); None when there is no such list."""
    found = None
    for match in _LISTING.finditer(text):
        line = text[match.end() :].split("\n", 1)[0]
        moves = [m for m in dict.fromkeys(_BRACKETED.findall(line)) if not _TEMPLATE.search(m)]
        found = moves or found
    return found


def _tictactoe_moves(game: Any) -> list[str]:
    board = game.state.game_state["board"]
    return [f"[{r * 3 + c}]" for r in range(3) for c in range(3) if board[r][c] == ""]


def _kuhn_poker_moves(game: Any) -> list[str] | None:
    tree = game.state.game_state.get("current_legal_action_tree")
    return [f"[{move}]" for move in tree] if isinstance(tree, dict) else None


def _connect_four_moves(game: Any) -> list[str]:
    top = game.state.game_state["board"][0]
    return [f"[col {c}]" for c, cell in enumerate(top) if cell == "."]


def _nim_moves(game: Any) -> list[str]:
    piles = game.state.game_state["piles"]
    return [f"[{i} {take}]" for i, left in enumerate(piles) for take in range(1, left + 1)]


# game family -> its legal moves read from the game's state (exact; other games' are parsed)
STATE_MOVES: dict[str, Callable[[Any], list[str] | None]] = {
    "TicTacToe": _tictactoe_moves,
    "KuhnPoker": _kuhn_poker_moves,
    "ConnectFour": _connect_four_moves,
    "Nim": _nim_moves,
}


# ----------------------------------------------------------------------------- the environment
class TextArenaEnv(TextEnv):
    """One TextArena game of one or two players (docs/environments.md, "TextArena games").

    ``env_id``: a TextArena id (``TicTacToe-v0``). ``opponent`` (two players): ``"random"``
    (the default), ``"self"`` or a function ``(observation, info) -> action``.
    ``policy_seat``: the learner's seat against an opponent (0, 1, ``"alternate"`` or
    ``"random"``). ``observation_mode``: ``"state"`` or ``"message"``. ``view`` (state mode):
    ``"history"`` (the whole transcript) or ``"board"`` (the rules, the game's messages and the
    latest board, as TextArena's ``-train`` variants). ``instruction``: text put after every
    observation. ``invalid_move_reward``: added to the reward of a step with an invalid
    move. ``action_format``:
    ``"last_bracket"`` or ``"raw"``. ``error_allowance``: invalid moves a player may retry
    before losing (None: the game's own, 1 in TextArena). ``num_players``: 1 or 2 (None:
    found by starting the game). ``game_kwargs``: keyword arguments for the game's class,
    over its registry entry's (``{max_rounds: 5}`` for KuhnPoker).
    """

    def __init__(
        self,
        env_id: str,
        opponent: str | Callable[[str, dict], str] | None = None,
        policy_seat: str | int = "alternate",
        observation_mode: str = "state",
        action_format: str = "last_bracket",
        error_allowance: int | None = None,
        num_players: int | None = None,
        game_kwargs: dict[str, Any] | None = None,
        view: str = "history",
        instruction: str | None = None,
        invalid_move_reward: float = 0.0,
    ) -> None:
        super().__init__()
        self.env_id = env_id
        self.name = PREFIX + env_id
        self._ta = _import_textarena(self.name)
        self.family, self._entry, registry_kwargs = registered_game(env_id)
        self._check_options(observation_mode, action_format, error_allowance, num_players, game_kwargs, policy_seat)
        if view not in VIEWS:
            raise EnvError(f"{self.name}: view must be 'history' or 'board' (got {view!r})")
        if view != "history" and observation_mode != "state":
            raise EnvError(f"{self.name}: view={view!r} is a state-mode view; set observation_mode='state'")
        if instruction is not None and not isinstance(instruction, str):
            raise EnvError(f"{self.name}: instruction must be text (got {instruction!r})")
        if isinstance(invalid_move_reward, bool) or not isinstance(invalid_move_reward, (int, float)):
            raise EnvError(f"{self.name}: invalid_move_reward must be a number (got {invalid_move_reward!r})")
        self.observation_mode = observation_mode
        self.view = view
        self.instruction = instruction.strip() if instruction else None
        self.invalid_move_reward = float(invalid_move_reward)
        self.action_format = action_format
        self.error_allowance = error_allowance
        self.policy_seat = policy_seat
        self._game_random_state = random.Random(0).getstate()
        self._game_kwargs = {**registry_kwargs, **(game_kwargs or {})}
        self._game = self._new_game(bool(game_kwargs))
        self.num_players = self._find_players(num_players)
        self.opponent_name, self._opponent = self._check_opponent(opponent)
        self.seat: int | None = None  # the learner's seat against an opponent; None in self-play / one player
        self.done = True
        self._episodes = 0

    # ------------------------------------------------------------------ construction
    def _check_options(self, observation_mode, action_format, error_allowance, num_players, game_kwargs, seat):
        def bad(what: str, got: Any, valid: str) -> EnvError:
            return EnvError(f"{self.name}: {what} must be {valid} (got {got!r})")

        if observation_mode not in ("state", "message"):
            raise bad("observation_mode", observation_mode, "'state' or 'message'")
        if action_format not in ACTION_FORMATS:
            raise bad("action_format", action_format, " or ".join(repr(f) for f in ACTION_FORMATS))
        if error_allowance is not None and (
            isinstance(error_allowance, bool) or not isinstance(error_allowance, int) or error_allowance < 0
        ):
            raise bad("error_allowance", error_allowance, "a whole number >= 0, or null for the game's own")
        if num_players not in (None, 1, 2) or isinstance(num_players, bool):
            raise bad("num_players", num_players, "1, 2 or null (found by starting the game)")
        if game_kwargs is not None and not isinstance(game_kwargs, dict):
            raise bad("game_kwargs", game_kwargs, "a mapping of keyword arguments for the game")
        if seat not in (0, 1, "alternate", "random") or isinstance(seat, bool):
            raise bad("policy_seat", seat, "0, 1, 'alternate' or 'random'")

    def _new_game(self, kwargs_given: bool = False) -> Any:
        """A new game object. Every reset builds one: some games keep state across their own
        ``reset`` (Kuhn poker shuffles its deck list in place), which would make an episode
        depend on the episodes before it."""
        try:
            with self._game_random():
                return self._entry(**self._game_kwargs)
        except TypeError as exc:
            if not kwargs_given:
                raise EnvError(f"{self.name}: building the game failed: {one_line_error(exc)}") from None
            raise EnvError(f"{self.name}: game_kwargs: {one_line_error(exc)}{_parameters(self._entry)}") from None
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - TextArena's own constructor
            raise EnvError(f"{self.name}: building the game failed: {one_line_error(exc)}") from None

    def _find_players(self, wanted: int | None) -> int:
        """1 or 2: ``wanted``, else the first count the game starts with (two, then one)."""
        errors = []
        for n in (wanted,) if wanted is not None else (2, 1):
            game = self._new_game()
            try:
                with self._game_random():
                    game.reset(num_players=n, seed=0)
                return n
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - TextArena refuses the count, or fails
                errors.append((n, exc))
        if wanted is None and all(isinstance(e, AssertionError) for _, e in errors):
            raise EnvError(
                f"{self.name} is not a one- or two-player game (TextArena: {one_line_error(errors[-1][1])}); "
                "ppokit plays games of one or two players"
            )
        n, exc = errors[0] if not isinstance(errors[0][1], AssertionError) else errors[-1]
        raise EnvError(f"{self.name}: starting the game with {n} player(s) failed: {one_line_error(exc)}")

    def _check_opponent(self, opponent: Any) -> tuple[str | None, Callable | None]:
        if self.num_players == 1:
            if opponent is not None:
                raise EnvError(f"{self.name} is a one-player game; it takes no opponent (got {opponent!r})")
            return None, None
        if opponent is None:
            opponent = "random"
        if callable(opponent) and not isinstance(opponent, str):
            return getattr(opponent, "__name__", "custom"), opponent
        if opponent not in OPPONENTS:
            raise EnvError(
                f"{self.name}: unknown opponent {opponent!r}; valid: {', '.join(OPPONENTS)}, or a function "
                "(observation, info) -> action"
            )
        return opponent, None

    @property
    def self_play(self) -> bool:
        """Two players and no built-in opponent: the caller plays both seats."""
        return self.num_players == 2 and self.opponent_name == "self"

    # ------------------------------------------------------------------ the game's random stream
    @contextlib.contextmanager
    def _game_random(self) -> Iterator[None]:
        """Run TextArena code with this environment's state of the global ``random`` generator."""
        outer = random.getstate()
        random.setstate(self._game_random_state)
        try:
            yield
        finally:
            self._game_random_state = random.getstate()
            random.setstate(outer)

    # ------------------------------------------------------------------ observations
    def _current_player(self) -> int:
        return int(self._game.state.current_player_id)

    def _render(self, messages: Sequence[tuple], skip_actions_of: int | None = None) -> str:
        """One ``[SENDER] text`` line per message (``GAME`` for the game, else its role)."""
        roles = getattr(self._game.state, "role_mapping", {}) or {}
        lines = []
        for sender, text, kind in messages:
            if skip_actions_of is not None and sender == skip_actions_of and _kind(kind) == "PLAYER_ACTION":
                continue
            name = "GAME" if sender == self._ta.GAME_ID else roles.get(sender, f"Player {sender}")
            lines.append(f"[{name}] {text}")
        return "\n".join(lines)

    def _receive(self, player: int) -> list[tuple]:
        """The messages ``player`` got since it last looked (TextArena's ``get_observation``
        for the player to move, else its queue), added to its history."""
        with self._game_random():
            if player == self._current_player():
                _, messages = self._game.get_observation()
            else:
                queues = self._game.state.observations
                messages, queues[player] = list(queues.get(player, [])), []
        messages = list(messages or [])
        self._history[player].extend(messages)
        self._fresh[player] = messages
        return messages

    def _observation(self, player: int, new: list[tuple]) -> str:
        """State mode: ``player``'s whole history (or its board view); message mode: its ``new``
        messages (after a newline, except at the start of its conversation); then the
        instruction, after a blank line."""
        if self.observation_mode == "state":
            text = self._render(self._history[player]) if self.view == "history" else self._board_view(player)
        else:
            text = self._render(new, skip_actions_of=player)
            text = text if len(new) == len(self._history[player]) else "\n" + text
        return f"{text}\n\n{self.instruction}" if self.instruction else text

    def _board_view(self, player: int) -> str:
        """``view="board"``: the rules prompt, the game's messages that are not moves, boards or
        notices (in order, one a line), this turn's notices, then the latest board, as
        TextArena's ``GameMessagesAndCurrentBoardObservationWrapper`` writes them (plain text, no
        ``[GAME]`` tags; it drops the notices: a player retrying an invalid move is shown why
        here)."""
        prompt, lines, board = [], [], []
        for _, text, kind in self._history[player]:
            kind = _kind(kind)
            if kind == "PROMPT":
                prompt.append(str(text))
            elif kind == "GAME_BOARD":
                board = [str(text)]
            elif kind not in ("PLAYER_ACTION", "GAME_ADMIN"):
                lines.append(str(text))
        lines += [str(text) for _, text, kind in self._fresh[player] if _kind(kind) == "GAME_ADMIN"]
        parts = ("\n".join(prompt), "\n".join(lines), *board)
        return "\n\n".join(part.strip("\n") for part in parts if part.strip())

    def _legal_actions(self, player: int) -> list[str] | None:
        """The legal moves of ``player`` (to move): from the game's state where ppokit knows
        how, else the list the game printed this turn outside its rules prompt (kept across a
        retry after an invalid move, unless the game refused a listed move)."""
        exact = STATE_MOVES.get(self.family)
        if exact is not None:
            with self._game_random():
                return exact(self._game)
        listed = _listed_moves(_game_text([m for m in self._fresh[player] if _kind(m[2]) != "PROMPT"]))
        if listed is None and self._retrying[player]:
            listed = self._listed[player]
        self._listed[player] = listed
        return listed

    def _turn_info(self, player: int) -> dict[str, Any]:
        info: dict[str, Any] = {}
        if self.num_players == 2:
            info["player"] = player
        legal = self._legal_actions(player)
        if legal:
            info["legal_actions"] = legal
        return info

    # ------------------------------------------------------------------ moves
    def _play(self, move: str) -> tuple[bool, str | None]:
        """Step the game with ``move``: (done, the invalid-move reason or None)."""
        mover = self._current_player()
        self._invalid = []
        with self._game_random():
            done, _ = self._game.step(move)
        reason = self._invalid[-1] if self._invalid else None
        if done and reason is None:
            game_info = (getattr(self._game.state, "game_info", None) or {}).get(mover, {})
            if game_info.get("invalid_move"):
                reason = str(game_info.get("reason") or "invalid move")
        self._retrying[mover] = reason is not None and not done
        if reason is not None and move in (self._listed[mover] or ()):
            self._listed[mover] = None  # the game refused a move it listed: the list is not to be trusted
        return bool(done), reason

    def _record_invalid_moves(self) -> None:
        """Note each reason the game gives ``set_invalid_move`` (TextArena's invalid-move hook;
        the game then decides what happens), and apply ``error_allowance``."""
        state = self._game.state
        if self.error_allowance is not None:
            state.error_allowance = self.error_allowance
        original = state.set_invalid_move

        def set_invalid_move(*args: Any, **kwargs: Any) -> Any:
            # the reason is set_invalid_move's first argument; a few games pass (progress, reason)
            reason = kwargs.get("reason", next((a for a in args if isinstance(a, str)), None))
            self._invalid.append(str(reason) if reason is not None else "invalid move")
            return original(*args, **kwargs)

        state.set_invalid_move = set_invalid_move

    def _opponent_moves(self) -> tuple[bool, list[str]]:
        """Let the opponent move until it is the learner's turn or the game ends."""
        moves: list[str] = []
        done = False
        while not done and self._current_player() != self.seat:
            if len(moves) >= MAX_OPPONENT_MOVES:
                raise RuntimeError(f"{self.name}: the opponent moved {len(moves)} times in a row")
            player = self._current_player()
            new = self._receive(player)
            info = {"player": player, **self._turn_info(player)}
            if self._opponent is not None:
                move = self._opponent(self._observation(player, new), info)
                if not isinstance(move, str):
                    raise EnvError(f"{self.name}: opponent {self.opponent_name} returned {move!r}; return a str")
            else:
                move = self.rng.choice(info.get("legal_actions") or self._fallback_moves(player))
            move = clean_action(move, self.action_format)
            moves.append(move)
            done, _ = self._play(move)
        return done, moves

    def _fallback_moves(self, player: int) -> list[str]:
        """The scripted fallback of the random opponent where the game lists no moves: the
        bracketed moves the game has shown ``player`` so far."""
        moves = list(dict.fromkeys(_BRACKETED.findall(_game_text(self._history[player]))))
        if not moves:
            raise EnvError(
                f"{self.name}: the random opponent finds no move (the game lists none and its messages show no "
                "[move]); use opponent=self or an opponent function"
            )
        return moves

    # ------------------------------------------------------------------ the end
    def _final(self, seat: int, info: dict[str, Any]) -> tuple[str, float, bool, bool, dict]:
        self.done = True
        new = self._receive(seat)
        with self._game_random():
            closed = self._game.close()
        rewards, game_info = closed if isinstance(closed, tuple) and len(closed) == 2 else (closed, {})
        if not isinstance(rewards, dict) or any(p not in rewards for p in range(self.num_players)):
            raise RuntimeError(f"{self.name}: the game ended without a reward for each player (got {rewards!r})")
        try:
            values = [float(rewards[p]) for p in range(self.num_players)]
        except (TypeError, ValueError):
            raise RuntimeError(f"{self.name}: the game ended with rewards {rewards!r}, not numbers") from None
        if self.num_players == 2:
            outcomes = [_compare(values[p], values[1 - p]) for p in range(2)]
            info.update(rewards=values, outcomes=outcomes, outcome=outcomes[seat])
        else:
            info["outcome"] = "win" if values[0] >= 1.0 else "loss"
        reason = (game_info or {}).get(seat, {}).get("reason") if isinstance(game_info, dict) else None
        if reason:
            info["reason"] = str(reason)
        return self._observation(seat, new), values[seat], True, False, info

    # ------------------------------------------------------------------ API
    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        self._seed(seed)
        info: dict[str, Any] = {}
        self.seat = None
        if self.num_players == 2 and not self.self_play:
            choice = (options or {}).get("seat", self.policy_seat)
            if choice == "alternate":
                self.seat = self._episodes % 2
            elif choice == "random":
                self.seat = self.rng.randrange(2)
            elif choice in (0, 1) and not isinstance(choice, bool):
                self.seat = choice
            else:
                raise EnvError(f"{self.name}: the seat must be 0, 1, 'alternate' or 'random' (got {choice!r})")
            info["seat"] = self.seat
        game_seed = self.rng.getrandbits(32)
        with self._game_random():
            random.seed(game_seed)  # for games that draw before TextArena's State seeds the generator
        self._game = self._new_game()
        with self._game_random():
            self._game.reset(num_players=self.num_players, seed=game_seed)
        self._history: dict[int, list[tuple]] = {p: [] for p in range(self.num_players)}
        self._fresh: dict[int, list[tuple]] = {p: [] for p in range(self.num_players)}
        self._listed: dict[int, list[str] | None] = dict.fromkeys(range(self.num_players))
        self._retrying: dict[int, bool] = dict.fromkeys(range(self.num_players), False)
        self._invalid: list[str] = []
        self._record_invalid_moves()
        self.done = False
        self._episodes += 1
        if self.seat is not None and self._current_player() != self.seat:
            done, moves = self._opponent_moves()
            info["opponent_actions"] = moves
            if done:  # an opening the game ends at once (a bug in the game or the opponent)
                raise RuntimeError(f"{self.name}: the game ended before the learner's first move")
        player = self._current_player()
        new = self._receive(player)
        info.update(self._turn_info(player))
        return self._observation(player, new), info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.done:
            raise RuntimeError(f"{self.name}: step() after the episode ended; call reset()")
        if not isinstance(action, str):
            raise TypeError(f"{self.name}: the action must be a str, got {type(action).__name__}")
        mover = self._current_player()
        move = clean_action(action, self.action_format)
        done, reason = self._play(move)
        info: dict[str, Any] = {"illegal": reason is not None, "action": move}
        if reason is not None:
            info["illegal_reason"] = reason
        if not done and self.seat is not None and self._current_player() != self.seat:
            done, moves = self._opponent_moves()
            info["opponent_actions"] = moves
        penalty = self.invalid_move_reward if reason is not None else 0.0
        if done:
            observation, reward, terminated, truncated, info = self._final(mover, info)
            return observation, reward + penalty, terminated, truncated, info
        player = self._current_player()
        new = self._receive(player)
        info.update(self._turn_info(player))
        return self._observation(player, new), penalty, False, False, info


def _parameters(entry: Any) -> str:
    """``"; the game takes: a, b"``: the keyword parameters of a game's class, for errors."""
    try:
        names = [n for n in inspect.signature(entry).parameters if n not in ("self", "args", "kwargs")]
    except (TypeError, ValueError):
        return ""
    return f"; the game takes: {', '.join(names) or 'nothing'}"


def _game_text(messages: Sequence[tuple]) -> str:
    """The text of the game's own messages (not the players'), one a line."""
    return "\n".join(str(text) for _, text, kind in messages if _kind(kind) != "PLAYER_ACTION")


def _kind(kind: Any) -> str:
    """The name of a TextArena ``ObservationType`` (``PLAYER_ACTION``, ``GAME_BOARD``, ...)."""
    return getattr(kind, "name", str(kind))


def _compare(mine: float, theirs: float) -> str:
    return "win" if mine > theirs else "loss" if mine < theirs else "draw"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ppokit.envs.textarena``: the TextArena ids, one a line, with why ppokit
    refuses some (``--all``: the ``-raw`` / ``-train`` variants too)."""
    argv = list(argv or [])
    try:
        registry = _registry(PREFIX + "...")
        ids = game_ids(include_variants="--all" in argv)
    except UserError as exc:
        print(exc)
        return 2
    for env_id in ids:
        family = _family(registry[env_id].entry_point)
        note = f"  (refused: {REFUSED[family]})" if family in REFUSED else ""
        print(f"{PREFIX}{env_id}{note}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
