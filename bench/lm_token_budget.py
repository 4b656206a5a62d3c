"""Token-budget micro-batches (``train.micro_batch_tokens``) against fixed ones, on a batch of mixed lengths.

One PPO update (LoRA actor and critic, GAE batch, one epoch, one mini-batch) and one
scoring pass (actor, critic and reference log-probs) of the same batch: responses of 8
to 256 tokens (uniform), prompts of 16 to 32 tokens, on a locally built Llama-style
model (``ppokit.lm.model.tiny``; hidden 128, 4 layers by default). Two settings, timed
alternately so that both see the same load on a shared host:

``fixed``   ``train.micro_batch_size`` rows per micro-batch, each padded to the batch's width
``budget``  ``train.micro_batch_tokens`` = micro_batch_size x the longest possible row: the same
            largest pass, but rows sorted by length, packed and cut to their own longest row

Printed: the padding share of the positions computed (before / after), micro-batch
counts, the median time of each phase and the speed-up (fixed / budget). The loss and
gradient are the same in both (tests/lm/test_token_budget.py).

Examples::

    python bench/lm_token_budget.py                    # 64 sequences, 1 thread, fp32
    python bench/lm_token_budget.py --batch 128 --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build_batch(tokenizer, n: int, seed: int, min_response: int, max_response: int, max_prompt: int):
    """(tensors of the rollout layout, response lengths): random tokens, EOS at each response's end."""
    from ppokit.lm.generation.engine import assemble

    g = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    prompt_lengths = torch.randint(max_prompt // 2, max_prompt + 1, (n,), generator=g)
    response_lengths = torch.randint(min_response, max_response + 1, (n,), generator=g)
    ids = torch.full((n, max_prompt), tokenizer.pad_token_id)
    am = torch.zeros((n, max_prompt), dtype=torch.long)
    for i, p in enumerate(prompt_lengths.tolist()):
        ids[i, max_prompt - p :] = torch.randint(4, vocab, (p,), generator=g)
        am[i, max_prompt - p :] = 1
    raw = torch.randint(4, vocab, (n, max_response), generator=g)
    raw[torch.arange(n), response_lengths - 1] = tokenizer.eos_token_id
    return assemble(ids, am, raw, eos_ids=[tokenizer.eos_token_id], pad_id=tokenizer.pad_token_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="sequences (default 64)")
    parser.add_argument("--micro", type=int, default=8, help="rows per fixed micro-batch (default 8)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--min-response", type=int, default=8)
    parser.add_argument("--max-response", type=int, default=256)
    parser.add_argument("--max-prompt", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from ppokit.config import build_config
    from ppokit.lm.model.hf import load_tokenizer
    from ppokit.lm.model.policy import build_policy
    from ppokit.lm.model.tiny import build_tiny_model
    from ppokit.lm.scoring import Scorer
    from ppokit.trainer import PPOTrainer

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    longest = args.max_prompt + args.max_response
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(
            Path(tmp) / "model",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            max_position_embeddings=longest + 8,
        )
        tokenizer = load_tokenizer(model)
        budget = args.micro * longest

        def cfg(tokens):
            return build_config(
                [
                    {
                        "workload": "lm",
                        "model": {"path": str(model), "cpu_kernels": False},
                        "rollout": {"max_new_tokens": args.max_response},
                        "train": {
                            "batch_size": args.batch,
                            "mini_batch_size": args.batch,
                            "micro_batch_size": args.micro,
                            "micro_batch_tokens": tokens,
                            "infer_micro_batch_size": args.micro,
                            "epochs": 1,
                            "iterations": 1000,
                            "lr_warmup_ratio": 0.0,
                        },
                        "algo": {"beta": 0.01},
                        "run": {"precision": args.precision},
                    }
                ]
            )

        settings = {"fixed": cfg(None), "budget": cfg(budget)}
        policy = build_policy(settings["fixed"], model, device=device, autocast_dtype=dtype, seed=0)
        policy.cast_frozen_weights(dtype)
        rollout = build_batch(tokenizer, args.batch, 0, args.min_response, args.max_response, args.max_prompt)
        tensors = {k: v.to(device) for k, v in rollout.items() if k != "truncated"}
        mask = tensors["mask"]
        g = torch.Generator().manual_seed(1)
        batch = {
            **{k: tensors[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "mask")},
            "advantages": torch.randn(mask.shape, generator=g).to(device) * mask,
            "returns": torch.randn(mask.shape, generator=g).to(device) * mask,
        }
        scorers = {
            name: Scorer(policy, args.micro, need_reference=True, micro_batch_tokens=c.train.micro_batch_tokens)
            for name, c in settings.items()
        }
        scored = scorers["fixed"].forward_passes(tensors)
        batch.update(
            old_log_prob=scored["old_log_prob"], old_values=scored["old_values"], ref_log_prob=scored["ref_log_prob"]
        )
        trainers = {name: PPOTrainer(c, policy, total_iterations=1000) for name, c in settings.items()}
        times: dict[str, dict[str, list[float]]] = {n: {"update": [], "score": []} for n in settings}
        padding = {}
        for repeat in range(args.repeats + 1):  # the first round warms up, not counted
            for name in settings:
                start = time.perf_counter()
                scorers[name].forward_passes(tensors)
                mid = time.perf_counter()
                metrics = trainers[name].update(dict(batch))
                end = time.perf_counter()
                padding[name] = metrics["padding_frac"]
                if repeat:
                    times[name]["score"].append(mid - start)
                    times[name]["update"].append(end - mid)

    lengths = tensors["attention_mask"].sum(1)
    from ppokit.trainer import micro_batch_indices

    counts = {
        name: len(micro_batch_indices(batch, args.micro, c.train.micro_batch_tokens)) for name, c in settings.items()
    }
    print(
        f"batch: {args.batch} sequences, responses {args.min_response}-{args.max_response} tokens, prompts "
        f"{args.max_prompt // 2}-{args.max_prompt}; rows {int(lengths.min())}-{int(lengths.max())} tokens "
        f"(mean {lengths.float().mean():.0f}); model hidden {args.hidden} x {args.layers} layers, LoRA actor + "
        f"critic, {args.precision}, {args.threads} thread(s), {device}"
    )
    print(
        f"fixed:  {args.micro} rows per micro-batch, {counts['fixed']} micro-batches, padding "
        f"{padding['fixed']:.1%} of the positions computed"
    )
    print(f"budget: micro_batch_tokens={budget}, {counts['budget']} micro-batches, padding {padding['budget']:.1%}")
    for phase in ("update", "score"):
        fixed, tokens = (statistics.median(times[n][phase]) for n in ("fixed", "budget"))
        print(
            f"{phase:6s}  fixed {fixed:7.2f} s   budget {tokens:7.2f} s   speed-up {fixed / tokens:.2f}x "
            f"(median of {args.repeats})"
        )


if __name__ == "__main__":
    main()
