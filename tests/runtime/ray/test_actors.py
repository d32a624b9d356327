"""Connecting to Ray: a cluster torchpipe starts itself listens on 127.0.0.1 only (#56)."""

import types

import pytest

from torchpipe.runtime.ray import actors


class FakeRay(types.SimpleNamespace):
    """What ``connect`` calls of the ``ray`` module, recorded; no cluster runs here."""

    def __init__(self, running: bool):
        super().__init__(calls=[], running=running)

    def is_initialized(self):
        return False

    def init(self, **kwargs):
        self.calls.append(kwargs)
        if kwargs.get("address") == "auto" and not self.running:
            raise ConnectionError("Could not find any running Ray instance")


def _connect(monkeypatch, running, address=None, env=None):
    fake = FakeRay(running)
    monkeypatch.setattr(actors, "require_ray", lambda: fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if env is not None:
        monkeypatch.setenv("RAY_ADDRESS", env)
    assert actors.connect(address) is fake
    return fake.calls


def test_a_cluster_torchpipe_starts_is_bound_to_localhost_and_says_so(monkeypatch):
    with pytest.warns(RuntimeWarning, match=r"bound to 127\.0\.0\.1"):
        calls = _connect(monkeypatch, running=False)
    assert calls[-1]["_node_ip_address"] == "127.0.0.1" and calls[-1]["include_dashboard"] is False
    assert "address" not in calls[-1]


@pytest.mark.filterwarnings("error")
def test_a_running_cluster_or_an_address_is_used_as_it_is(monkeypatch):
    assert _connect(monkeypatch, running=True) == [{"address": "auto", "ignore_reinit_error": True}]
    assert _connect(monkeypatch, running=False, address="ray://head:10001") == [
        {"address": "ray://head:10001", "ignore_reinit_error": True}
    ]
    assert _connect(monkeypatch, running=False, env="10.0.0.1:6379") == [
        {"address": None, "ignore_reinit_error": True}
    ]
