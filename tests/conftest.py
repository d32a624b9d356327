"""Settings shared by every test module: the hypothesis profiles, and one local Ray cluster.

``ci`` (the default) keeps property tests to seconds: few examples, derandomized (the same
examples every run, so a failure reproduces), no deadline (the 2-core CI machine is shared)
and no example database written. ``HYPOTHESIS_PROFILE=dev`` searches wider, for local runs.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=50, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
settings.register_profile("dev", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="package")
def ray_cluster():
    """A local Ray cluster on 127.0.0.1: 2 CPUs, no dashboard, a small object store; shut down
    after the tests of the package that asked for it (left running through the rest of the suite, the
    cluster ended the test process twice, at exit 1 with no output, tests after its own).
    Actors kept warm between tests are killed first."""
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
    yield ray
    from torchpipe.runtime.ray.actors import IDLE

    IDLE.clear()
    ray.shutdown()
