"""An LM run's inputs: its training prompts, held-out prompts and reward function.

:func:`load_data` reads and checks them (a built-in task or prompt files, ``data.reward``
or the task's own verifier, the chat template) before any model loads, so that a bad
file or reward function fails at once; ``ppokit train`` and the run read them through it.
``ppokit eval`` of a run reads its held-out prompts and reward spec alone, by the same rules
(:func:`load_heldout`). :func:`read_prompt_run` and :func:`check_episode_run` are what the
workload registry (:data:`ppokit.workloads.WORKLOADS`) asks before it imports a workload's
modules (torch, transformers): a bad path or name is one line within a second.
"""

from __future__ import annotations

from typing import Any

from ppokit.config import Config
from ppokit.envs.registry import load_env_factory
from ppokit.errors import UserError
from ppokit.lm.data.chat import chat_renderer, model_chat_renderer, render_records
from ppokit.lm.data.sources import is_file_source, load_prompts
from ppokit.lm.data.tasks import get_task
from ppokit.lm.model.model_path import local_model_directory
from ppokit.lm.rewards.functions import load_reward_fn, reward_fields


def chat_render(cfg: Config, tokenizer=None, where: str | None = None):
    """``data.chat_template``'s renderer (:func:`ppokit.lm.data.chat.chat_renderer`) with ``tokenizer``
    (default: model.path's), or None when prompts are used as they are."""
    if not cfg.data.chat_template:
        return None
    if tokenizer is None:
        return model_chat_renderer(
            cfg.model.path,
            what="model.path",
            option="data.chat_template=true",
            fix="set model.path to a chat model's directory",
        )
    return chat_renderer(tokenizer, where or "the model")


def load_data(cfg: Config, tokenizer=None, where: str | None = None) -> tuple[list[dict], list[dict], Any]:
    """(train prompt records, held-out records, reward function), checked before any model loads.

    Files are read with ``data.prompt_key`` / ``data.answer_key``. The reward function is
    ``data.reward``, else the task's own; None for a prompt file
    scored by ``data.reward_model`` alone (there is then no held-out accuracy). With
    ``data.chat_template`` the prompts come rendered with the chat template of
    ``tokenizer`` (``where`` names it in errors; default: model.path's tokenizer).
    """
    d = cfg.data
    reward_spec = _reward_spec(cfg)
    reward_fn = load_reward_fn(reward_spec) if reward_spec is not None else None
    train_items = load_prompts(
        d.prompts, "train", chat=d.chat_template, prompt_key=d.prompt_key, answer_key=d.answer_key
    )
    eval_items = _heldout_items(cfg)
    if reward_fn is not None:
        check_reward_fields(train_items, reward_fn, d.prompts)
        check_reward_fields(eval_items, reward_fn, d.eval_prompts or d.prompts)
    render = chat_render(cfg, tokenizer, where)
    if render is not None:
        train_items, eval_items = render_records(train_items, render), render_records(eval_items, render)
    return train_items, eval_items, reward_fn


def read_prompt_run(cfg: Config) -> dict[str, Any]:
    """A single-turn run's inputs before its workload is built: ``model.path`` names a model
    (:func:`~ppokit.lm.model.model_path.local_model_directory`), then :func:`load_data`, whose
    records and reward function the workload keeps (``data=``: read once)."""
    _check_model_path(cfg)
    return {"data": load_data(cfg)}


def check_episode_run(cfg: Config) -> dict[str, Any]:
    """A multi-turn run's names before its workload is built: ``model.path`` names a model and
    ``textenv.env`` an environment (the workload builds it; nothing is handed on)."""
    _check_model_path(cfg)
    load_env_factory(cfg.textenv.env)
    return {}


def _check_model_path(cfg: Config) -> None:
    if cfg.model.path != "tiny":
        local_model_directory(cfg.model.path)


def check_reward_fields(records: list[dict], reward_fn, source: str) -> None:
    """Every record holds a value for each field the reward function requires: a missing or
    null ``answer`` would otherwise fail (or score 0) only once the first batch is scored."""
    unfilled = [(i, reward_fn.unfilled_fields(reward_fields(r))) for i, r in enumerate(records)]
    unfilled = [(i, names) for i, names in unfilled if names]
    if not unfilled:
        return
    first, names = unfilled[0]
    prompt = str(records[first]["prompt"])
    raise UserError(
        f"{source}: {len(unfilled)} of {len(records)} records have no value for {', '.join(names)}, which "
        f"reward function '{reward_fn.name}' needs (the first: record {first + 1}, prompt "
        f"{prompt[:40] + ('...' if len(prompt) > 40 else '')!r}); fill it in every record, or name its column "
        "(data.answer_key)"
    )


def load_heldout(cfg: Config, tokenizer, where: str | None = None) -> tuple[list[dict], str | None]:
    """(held-out records, the reward spec) of a run of ``cfg``, as :func:`load_data` reads them
    (rendered with ``tokenizer``'s chat template under ``data.chat_template``), without the
    training prompts: what ``ppokit eval`` scores a run's trained actor on. The spec is None for
    a prompt file scored by ``data.reward_model`` alone; the function is loaded by its scorer."""
    render = chat_render(cfg, tokenizer, where)
    reward_spec = _reward_spec(cfg)
    eval_items = _heldout_items(cfg)
    return (render_records(eval_items, render) if render is not None else eval_items), reward_spec


def _reward_spec(cfg: Config):
    """``data.reward``, else the task's own verifier; None for a prompt file scored by
    ``data.reward_model`` alone (a file with neither is a :class:`UserError`)."""
    d = cfg.data
    if d.reward is not None:
        return d.reward
    if not is_file_source(d.prompts):
        return get_task(d.prompts).default_reward
    if d.reward_model is None:
        raise UserError(
            f"data.reward: the prompt file {d.prompts} needs a reward function "
            "(a built-in name, module:fn or file.py:fn) or data.reward_model"
        )
    if d.eval_prompts is not None and d.eval_size:
        raise UserError(
            "data.eval_prompts: the held-out accuracy is scored by data.reward (a verifier), "
            "and the reward model alone does not say what is correct; set data.reward, or "
            "data.eval_size=0"
        )
    return None


def load_sft_records(cfg: Config) -> list[dict] | None:
    """The warm start's prompt/completion records (the ``sft`` split of ``data.prompts``, the first
    ``data.sft_examples``), not rendered; None without a warm start (``data.sft_epochs=0``)."""
    d = cfg.data
    if not d.sft_epochs:
        return None
    keys = {"prompt_key": d.prompt_key, "answer_key": d.answer_key}
    return load_prompts(d.prompts, "sft", n=d.sft_examples, chat=d.chat_template, **keys)


def check_warm_start_heldout(cfg: Config, eval_items: list[dict]) -> None:
    """A warm start (data.sft_epochs > 0) picks its best epoch by the held-out accuracy: none is one line."""
    d = cfg.data
    if not d.sft_epochs or eval_items:
        return
    why = (
        "data.eval_size=0 leaves none: set data.eval_size > 0"
        if d.eval_size == 0
        else f"the prompt file {d.prompts} has no held-out split: give data.eval_prompts"
    )
    raise UserError(
        f"data.sft_epochs > 0 needs held-out prompts to pick the best warm-start model; {why}, or data.sft_epochs=0"
    )


def _heldout_items(cfg: Config) -> list[dict]:
    """The held-out records, not rendered: ``data.eval_prompts``' first ``data.eval_size``, else
    the task's held-out split; none with ``data.eval_size=0`` or for a prompt file alone."""
    d = cfg.data
    if d.eval_size == 0:
        return []
    if d.eval_prompts is not None:
        keys = {"prompt_key": d.prompt_key, "answer_key": d.answer_key}
        return load_prompts(d.eval_prompts, "eval", chat=d.chat_template, **keys)[: d.eval_size]
    if not is_file_source(d.prompts):
        return load_prompts(d.prompts, "eval", n=d.eval_size)
    return []
