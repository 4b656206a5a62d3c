"""``ppokit generate`` and ``ppokit chat``: talk to a trained actor or a model directory.

Both load through :func:`ppokit.lm.generation.loading.load_generator` (a run directory means its
trained actor: the LoRA adapter applied to the backbone) and generate through the one
generation path, a rollout engine (:mod:`ppokit.lm.generation.base`), with the sampling options
``temperature``, ``top_p``, ``top_k`` and ``max_new_tokens`` (the run's by default) or
greedy decoding.

``generate`` answers each ``--prompt`` (or each non-empty line of standard input when
none is given), ``--num-samples`` times. With the chat template (the run's
``data.chat_template``, or ``--chat-template``) a prompt is one user message, after the
``--system`` message if any.

``chat`` reads user messages from standard input, one per line, and keeps the
conversation: every turn renders the whole history with the tokenizer's chat template,
as ``trl chat`` does. A model without a chat template (the built-in tiny model) answers
each line on its own. Commands: ``/clear`` starts over, ``/set KEY=VALUE`` changes a
sampling option (``/set temperature=0.2``), ``/help``, ``/exit`` (or end of input).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ppokit.commands.arguments import add_command, add_sampling_options, int_at_least, sampling_kwargs
from ppokit.errors import UserError

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")
HELP = (
    "commands: /clear (forget the conversation), /set KEY=VALUE (temperature, top_p, top_k, max_new_tokens), "
    "/help, /exit (or end of input)"
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Two commands: ``generate`` and ``chat``."""
    gen = add_command(
        subparsers,
        "generate",
        run_generate,
        help="generate from a trained actor or a model directory",
        description="Answer each --prompt (or each line of standard input) with the trained "
        "actor of RUN_DIR (its LoRA adapter applied) or a Hugging Face model "
        "directory, through ppokit's generation path.",
    )
    gen.add_argument("path", metavar="RUN_DIR|MODEL_DIR")
    gen.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a prompt (repeat for several; default: one per line of standard input)",
    )
    gen.add_argument("--num-samples", type=int_at_least(1), default=1, help="responses per prompt (default 1)")
    gen.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    gen.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap each prompt as a user message in the chat template (default: as the run did)",
    )
    gen.add_argument("--system", default=None, help="a system message (with the chat template)")
    add_sampling_options(gen)

    chat = add_command(
        subparsers,
        "chat",
        run_chat,
        help="chat with a trained actor or a model directory",
        description="Read messages from standard input, one per line, and answer with the "
        "conversation rendered by the model's chat template. Commands: /clear, "
        "/set KEY=VALUE (temperature, top_p, top_k, max_new_tokens), /help, /exit.",
    )
    chat.add_argument("path", metavar="RUN_DIR|MODEL_DIR")
    chat.add_argument("--system", default=None, help="a system message that opens the conversation")
    chat.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    add_sampling_options(chat)


def run_generate(args: argparse.Namespace) -> int:
    return generate_main(
        args.path,
        args.prompt,
        chat_template=args.chat_template,
        system=args.system,
        num_samples=args.num_samples,
        greedy=args.greedy,
        seed=args.seed,
        **sampling_kwargs(args),
    )


def run_chat(args: argparse.Namespace) -> int:
    return chat_main(args.path, system=args.system, greedy=args.greedy, seed=args.seed, **sampling_kwargs(args))


class Conversation:
    """Chat history rendered with the tokenizer's chat template (no template: each turn alone)."""

    def __init__(self, tokenizer, label: str, system: str | None = None):
        from ppokit.lm.data.chat import encoder_adds_bos

        self.tokenizer, self.label, self.system = tokenizer, label, system
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.strip_bos = self.templated and encoder_adds_bos(tokenizer)
        self.messages: list[dict[str, str]] = []
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_for(self, user_text: str) -> str:
        """The text to generate from after the user says ``user_text`` (history included)."""
        from ppokit.lm.data.chat import apply_template

        if not self.templated:
            return user_text
        messages = self.messages + [{"role": "user", "content": user_text}]
        return apply_template(
            self.tokenizer,
            messages,
            strip_bos=self.strip_bos,
            generation_prompt=True,
            where=self.label,
            prompt=user_text,
        )

    def add_turn(self, user_text: str, reply: str) -> None:
        if self.templated:
            self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]


def _use_template(gen, chat_template: bool | None) -> bool:
    use = chat_template if chat_template is not None else bool(gen.cfg is not None and gen.cfg.data.chat_template)
    if use and not gen.has_chat_template:
        raise UserError(
            f"--chat-template: the tokenizer of {gen.label} has no chat template; leave the option "
            "out to use the prompt as it is"
        )
    return use


def generate_main(
    path: str,
    prompts: Sequence[str],
    *,
    chat_template: bool | None = None,
    system: str | None = None,
    num_samples: int = 1,
    greedy: bool = False,
    seed: int = 0,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
    device: str | None = None,
    **sampling: Any,
) -> int:
    """``ppokit generate``: print the response to each prompt (module docstring)."""
    if num_samples < 1:
        raise UserError(f"--num-samples must be at least 1 (got {num_samples})")
    from ppokit.lm.model.model_path import open_model_path  # (light: not at import, every command's start)

    run = open_model_path(path)  # a bad path is one line before the model's modules are imported
    import torch

    from ppokit.lm.generation.loading import load_generator

    gen = load_generator(run, device=device, **sampling)
    if not prompts:
        prompts = [line.rstrip("\n") for line in stdin if line.strip()]
        if not prompts:
            raise UserError("no prompt: give --prompt TEXT, or prompts on standard input (one per line)")
    texts = list(prompts)
    if _use_template(gen, chat_template):
        conversation = Conversation(gen.tokenizer, gen.label, system)
        texts = [conversation.prompt_for(p) for p in prompts]
    torch.manual_seed(seed)
    rollout = gen.engine.generate(texts, group_size=1 if greedy else num_samples, greedy=greedy)
    per_prompt = 1 if greedy else num_samples
    for i, prompt in enumerate(prompts):
        replies = rollout.texts[i * per_prompt : (i + 1) * per_prompt]
        for j, reply in enumerate(replies):
            if len(prompts) > 1 or per_prompt > 1:
                label = f"[{i + 1}]" if per_prompt == 1 else f"[{i + 1}.{j + 1}]"
                stdout.write(f"{label} {prompt}\n")
            stdout.write(reply + "\n")
    stdout.flush()
    return 0


def chat_main(
    path: str,
    *,
    system: str | None = None,
    greedy: bool = False,
    seed: int = 0,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
    stderr: TextIO = sys.stderr,
    device: str | None = None,
    **sampling: Any,
) -> int:
    """``ppokit chat``: a conversation on standard input and output (module docstring)."""
    from ppokit.lm.model.model_path import open_model_path  # (light: not at import, every command's start)

    run = open_model_path(path)  # a bad path is one line before the model's modules are imported
    import torch

    from ppokit.config import rollout_options
    from ppokit.lm.generation.loading import load_generator

    gen = load_generator(run, device=device, **sampling)
    conversation = Conversation(gen.tokenizer, gen.label, system)
    interactive = stdin.isatty()
    stderr.write(f"chatting with {gen.label}; {HELP}\n")
    if not conversation.templated:
        stderr.write("(no chat template: each line is answered on its own, without the conversation)\n")
    torch.manual_seed(seed)
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        command = text.strip()
        if command in ("/exit", "/quit"):
            break
        if command == "/help":
            stderr.write(HELP + "\n")
            continue
        if command == "/clear":
            conversation.clear()
            stderr.write("(conversation cleared)\n")
            continue
        if command.startswith("/set"):
            key, sep, value = command[len("/set") :].strip().partition("=")
            key = key.strip()
            if not sep or key not in SAMPLING_KEYS:
                stderr.write(f"usage: /set KEY=VALUE with KEY one of {', '.join(SAMPLING_KEYS)}\n")
                continue
            try:
                gen.engine.cfg = rollout_options(gen.engine.cfg, **{key: value.strip()})
            except UserError as exc:
                stderr.write(f"{exc}\n")
                continue
            stderr.write(f"({key} = {getattr(gen.engine.cfg, key)})\n")
            continue
        if command.startswith("/"):
            stderr.write(f"unknown command {command.split()[0]}; {HELP}\n")
            continue
        try:
            prompt = conversation.prompt_for(text)
            reply = gen.engine.generate([prompt], greedy=greedy).texts[0]
        except UserError as exc:  # the conversation outgrew the model's positions
            stderr.write(f"{exc}; /clear starts over\n")
            continue
        conversation.add_turn(text, reply)
        stdout.write(reply + "\n")
        stdout.flush()
    return 0
