"""One local Ray cluster for the Ray tests (test_ray.py, test_ray_data.py), started on first use."""

import pytest


@pytest.fixture(scope="package")
def ray_cluster():
    """A local Ray cluster on 127.0.0.1: 2 CPUs, no dashboard, a small object store; shut down
    after the package's tests. Actors kept warm between tests are killed first."""
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
    from torchpipe.runtime.ray_actors import IDLE

    IDLE.clear()
    ray.shutdown()
