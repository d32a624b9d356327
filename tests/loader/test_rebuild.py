"""Noticing a tp.DataLoader rebuilt by another library: who warns, once, pointing at the user."""

import sys
import warnings

import pytest

from torchpipe.loader import rebuild


@pytest.fixture(autouse=True)
def _not_warned(monkeypatch):
    monkeypatch.setattr(rebuild, "warned", False)


def _module(name, source, **names):
    """The functions ``source`` defines, run as module ``name`` (a file of its own)."""
    scope = {"__name__": name, "sys": sys, **names}
    exec(compile(source, f"<{name}>", "exec"), scope)
    return scope


def _reader(module_name):
    """A read of a loader attribute from ``module_name``, through a torchpipe property."""
    prop = _module(
        "torchpipe.fake_loader",
        "def prop():\n    notice(sys._getframe(1))\n",
        notice=rebuild.notice_read,
    )["prop"]
    return _module(module_name, "def read():\n    prop()\n", prop=prop)["read"]


def test_a_read_by_a_rebuilder_warns_once_naming_it_and_the_supported_path():
    read = _reader("accelerate.data_loader")
    with pytest.warns(UserWarning, match=r"accelerate\.data_loader is rebuilding") as caught:
        read()
    assert "use_torchpipe" in str(caught[0].message) and rebuild.warned
    assert caught[0].filename == __file__  # the user's line, past the libraries' frames
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read()  # once a process


@pytest.mark.parametrize("reader", ["torch.utils.data", "torchpipe.loader", "lightning", "mine"])
def test_reads_by_others_never_warn(reader):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _reader(reader)()
        rebuild.notice_read(None)
    assert not rebuild.warned


def test_a_rebuild_torchpipe_expects_does_not_warn_in_its_block_only():
    read = _reader("accelerate.data_loader")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with rebuild.expected():
            with rebuild.expected():
                read()
            read()  # still in the outer block
    assert not rebuild.warned
    with pytest.warns(UserWarning, match="rebuilding"):
        read()
