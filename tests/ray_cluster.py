"""One local Ray cluster for a test package's Ray tests (``ray_cluster``, a package fixture).

Each package that has Ray tests (tests/integrations, tests/runtime/ray) makes the fixture in its
own conftest.py, so the cluster is shut down when that package's tests end: a cluster left
running through the rest of the suite ended the test process tests after its own: a test that
kills worker processes can kill Ray's GCS server (a child of this process too), and 60 s later
Ray's driver ends the process (exit 1; its message goes to pytest's captured stderr, so nothing
shows). A package-scoped fixture in the root conftest.py would live as long as the session.
"""

from collections.abc import Iterator
from typing import Any

import pytest


def local_ray_cluster() -> Iterator[Any]:
    """A local Ray cluster on 127.0.0.1: 2 CPUs, no dashboard, a small object store; yields the
    ``ray`` module and shuts the cluster down after killing the actors kept warm between tests."""
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        address="local",
        _node_ip_address="127.0.0.1",
        object_store_memory=256 << 20,
        logging_level="ERROR",
        log_to_driver=False,
    )
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield ray
    finally:
        from torchpipe.runtime.ray.actors import IDLE

        try:
            IDLE.clear()
        finally:
            ray.shutdown()  # always: a driver whose cluster dies later ends this process 60 s after
