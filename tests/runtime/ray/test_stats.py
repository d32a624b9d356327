"""What a Ray actor pool counts: each actor's calls, and what receiving results cost."""

import pytest

from torchpipe.runtime.ray.stats import ActorStats, PoolStats


def test_the_stats_count_calls_and_transfers():
    actor = ActorStats()
    assert actor.as_dict() == {"calls": 0, "call_s": 0.0, "cpu_s": 0.0, "restarts": 0}
    actor.call(0.2, 0.1)
    actor.call(0.4, 0.3)
    assert actor.as_dict()["calls"] == 2 and actor.as_dict()["call_s"] == pytest.approx(0.3)
    stats = PoolStats()
    assert stats.as_dict({})["transfer_bytes_per_s"] == 0.0
    stats.received(1000, 0.5)
    stats.received(3000, 0.5)
    report = stats.as_dict({"a": {}})
    assert report["results"] == 2 and report["transfer_s"] == pytest.approx(0.5)
    assert report["transfer_bytes_per_s"] == pytest.approx(4000.0) and report["actors"] == {"a": {}}
