"""``ppokit eval`` of a multi-turn run: the greedy win rates or success rate of its trained actor.

:func:`evaluate_textenv_run` plays the run's evaluation episodes as its own evaluations do
(:class:`~ppokit.lm.multi_turn.source.TextEnvEvaluator`); :func:`report_run` is what the
command prints (:data:`ppokit.workloads.EVALUATORS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ppokit.envs import make_env
from ppokit.errors import UserError
from ppokit.lm.generation.loading import load_generator
from ppokit.lm.multi_turn.source import TextEnvEvaluator, check_env_output, engine_generate
from ppokit.lm.multi_turn.streams import StreamCodec
from ppokit.persistence.rundir import POLICY_META_FILE, RunDir


def evaluate_textenv_run(
    run_dir: str | Path | RunDir, episodes: int | None = None, *, device: str | None = None
) -> dict:
    """A multi-turn run's greedy evaluation (:class:`~ppokit.lm.multi_turn.source.TextEnvEvaluator`) of its
    trained actor: ``{"metrics", "episodes", "message", "checkpoint"}``; ``episodes`` per
    opponent (default: the run's ``textenv.eval_episodes``, else 200)."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    ckpt = run.lm_checkpoint
    if ckpt is None:
        raise UserError(f"{run.path} has no language-model checkpoint (no {POLICY_META_FILE})")
    if episodes is not None and episodes < 1:
        raise UserError(f"--episodes must be at least 1 (got {episodes})")
    gen = load_generator(run, device=device)
    cfg = gen.cfg
    cfg.textenv.eval_episodes = episodes or cfg.textenv.eval_episodes or 200
    probe = make_env(cfg.textenv.env, **cfg.textenv.kwargs)
    name = getattr(probe, "env_name", cfg.textenv.env)
    codec = StreamCodec(
        gen.tokenizer,
        mode=check_env_output(probe, name),
        chat=cfg.data.chat_template,
        where=f"the checkpoint {ckpt}",
        env_name=name,
        stop_ids=gen.engine.eos_ids,
    )
    evaluator = TextEnvEvaluator(cfg, engine_generate(gen.engine), codec, gen.engine.max_positions, name)
    metrics = evaluator.evaluate("periodic")
    return {
        "metrics": metrics,
        "episodes": cfg.textenv.eval_episodes,
        "message": evaluator.message("periodic", metrics),
        "checkpoint": str(ckpt),
    }


def report_run(run: RunDir, /, *, episodes: int | None = None, device: str | None = None, **_: Any) -> str:
    """What ``ppokit eval`` prints for a multi-turn run: :func:`evaluate_textenv_run`'s message."""
    result = evaluate_textenv_run(run, episodes, device=device)
    return f"{result['message']} ({result['checkpoint']})"
