"""The demo's PPO iteration: time per phase and the process's peak memory, as one JSON line.

Runs ``ppokit train arith`` for ``--iterations`` iterations without the warm start and without
evaluations (the preset's PPO settings as they are), in its own process on ``--threads``
threads, and prints the medians from the third iteration on of ``time_iteration``,
``time_update``, ``time_score`` and ``time_collect``, and the process's peak resident
memory (``ru_maxrss``). Made for ``bench/compare.py``, which runs it at two revisions in
ABBA order::

    python bench/compare.py 0e94529 HEAD --rounds 3 -- python bench/demo_iteration.py
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"train.iterations={a.iterations}",
            "data.sft_epochs=0",
            "data.eval_size=0",
            f"run.torch_threads={a.threads}",
            f"run.output_dir={out}",
            "run.tensorboard=false",
            "run.progress=false",
        ]
        subprocess.run([sys.executable, "-m", "ppokit", "train", "arith", *overrides], check=True, capture_output=True)
        rows = [json.loads(line) for path in Path(out).rglob("metrics.jsonl") for line in path.read_text().splitlines()]
    rows = [r for r in rows if "time_iteration" in r][2:]
    result = {key: statistics.median(r[key] for r in rows) for key in ("time_iteration", "time_update", "time_score")}
    result["time_collect"] = statistics.median(r["time_collect"] for r in rows)
    result["process_peak_rss_gb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e9
    print(json.dumps(result))


if __name__ == "__main__":
    main()
