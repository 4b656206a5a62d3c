"""One local Ray (2 CPUs, no dashboard) for all the scale-out tests of a session.

Starting Ray costs seconds, so the session shares one instance; runs in these tests
find it initialised and join it (:class:`ppokit.cluster.ray_cluster.Cluster` then leaves it
running and removes only its own actors and placement group). The fixture shuts it
down at the end of the session, and checks that no run left an actor or a placement
group behind.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the scale-out tests need Ray: pip install 'ppokit[ray]'")

# Small enough for the tests; the bench (bench/dist.py) runs the arith preset at full size.
TEST_TINY_SPEC = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 64, "seed": 0}


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray (``ray.init(num_cpus=2)``, as a run that starts its own starts it:
    every worker at the driver's priority)."""
    from ppokit.cluster.ray_cluster import start_local_ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def cluster_clean(ray_cluster):
    """After the test: every actor of the session is dead and every placement group removed."""
    yield ray_cluster
    from ray.util import placement_group_table

    alive = [pg for pg in placement_group_table().values() if pg["state"] != "REMOVED"]
    assert not alive, f"placement groups left behind: {alive}"
    deadline = time.monotonic() + 10  # Ray returns the resources of removed groups asynchronously
    while ray_cluster.available_resources().get("CPU", 0) < ray_cluster.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, "a run left actors holding CPUs"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from ppokit.lm.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("dist-lm") / "tiny", **TEST_TINY_SPEC)


@pytest.fixture(scope="session")
def digits_reward(tmp_path_factory) -> str:
    """A dense reward for an untrained model (the share of digits in the response), as ``file.py:fn``."""
    path = tmp_path_factory.mktemp("dist-reward") / "digits.py"
    path.write_text("def digits(prompt, response, **fields):\n    return sum(c.isdigit() for c in response) / 4\n")
    return f"{path}:digits"
