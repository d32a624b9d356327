"""The package's Ray tests share one local Ray cluster, shut down when they end."""

import pytest

from tests.ray_cluster import local_ray_cluster

ray_cluster = pytest.fixture(scope="package")(local_ray_cluster)
