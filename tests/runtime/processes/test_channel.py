import os

import pytest

from torchpipe.runtime.processes.channel import Channel, ChannelClosed


def test_messages_keep_boundaries_and_large_ones_travel_out_of_band():
    a, b = Channel.pair()
    a.send(("small", 1))
    a.send(("big", b"x" * 300_000))
    assert b.poll(1)
    assert b.recv() == (("small", 1), [])
    message, fds = b.recv()
    assert message[0] == "big" and len(message[1]) == 300_000 and fds == []
    a.close(), b.close()


def test_file_descriptors_ride_with_their_message():
    a, b = Channel.pair()
    r, w = os.pipe()
    a.send(("fd",), [w])
    message, fds = b.recv()
    os.write(fds[0], b"hi")
    assert os.read(r, 2) == b"hi"
    for fd in (r, w, *fds):
        os.close(fd)


def test_closed_peer_is_reported():
    a, b = Channel.pair()
    a.close()
    assert b.poll(1)
    with pytest.raises(ChannelClosed):
        b.recv()
    with pytest.raises(ChannelClosed):
        b.send("x")
    c, d = Channel.pair()
    assert not c.poll(0.01)
    c.close(), d.close()
