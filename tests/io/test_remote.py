"""Remote paths through fsspec, against a real S3-compatible server (moto's, on 127.0.0.1,
started and stopped here) behind a proxy that can cut responses part way."""

from __future__ import annotations

import socket
import sys
import threading

import fsspec
import pytest
import s3fs
from moto.server import ThreadedMotoServer

import torchpipe as tp

BUCKET = "torchpipe-test"
RECORDS = [bytes([i % 251]) * (20_000 + i) for i in range(60)]  # about 1.2 MB


class FaultProxy:
    """A TCP proxy to ``127.0.0.1:upstream`` that, once armed, cuts every connection whose
    response bytes would pass ``allow`` bytes in all (``cuts`` times), mid-response."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        self.passed, self.allow, self.cuts_left, self.cut = 0, None, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def arm(self, allow: int, cuts: int) -> None:
        with self.lock:
            self.passed, self.allow, self.cuts_left, self.cut = 0, allow, cuts, 0

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=10)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, response: bool) -> None:
        try:
            while data := source.recv(65536):
                if response and self._cut(data, sink):
                    break
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _cut(self, data: bytes, sink: socket.socket) -> bool:
        with self.lock:
            if self.allow is None or self.cuts_left == 0 or self.passed + len(data) <= self.allow:
                self.passed += len(data)
                return False
            keep = max(self.allow - self.passed, 0)
            self.passed += keep
            self.cuts_left -= 1
            self.cut += 1
        sink.sendall(data[:keep])
        return True

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.server.close()


@pytest.fixture(scope="module")
def s3():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    proxy = FaultProxy(server.get_host_and_port()[1])
    saved = dict(fsspec.config.conf)
    fsspec.config.conf["s3"] = {
        "endpoint_url": f"http://127.0.0.1:{proxy.port}",
        "key": "testing",
        "secret": "testing",
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    s3fs.S3FileSystem.clear_instance_cache()
    fs = fsspec.filesystem("s3")
    fs.mkdir(BUCKET)
    try:
        yield fs, proxy
    finally:
        fsspec.config.conf.clear()
        fsspec.config.conf.update(saved)
        s3fs.S3FileSystem.clear_instance_cache()
        proxy.close()
        server.stop()


@pytest.fixture
def files(s3, monkeypatch):
    fs, proxy = s3
    # s3fs gives up at once: the retries here are ours
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    proxy.arm(allow=0, cuts=0)
    for k in range(3):
        # writes go through fsspec too
        with tp.io.TFRecordWriter(f"s3://{BUCKET}/train-{k}.tfrecord") as writer:
            for record in RECORDS[k::3]:
                writer.write(record)
    return fs, proxy


def test_list_files_and_tfrecords_on_s3(files):
    urls = [f"s3://{BUCKET}/train-{k}.tfrecord" for k in range(3)]
    assert list(tp.list_files(f"s3://{BUCKET}/train-*.tfrecord")) == urls
    ds = tp.list_files(f"s3://{BUCKET}/train-*.tfrecord").interleave(
        tp.TFRecordDataset, cycle_length=3
    )
    assert list(ds) == RECORDS
    records = tp.io.TFRecordRecords(urls)  # an index by scanning, then one ranged request a record
    assert [records[i] for i in (0, 19, 20, 59)] == [
        RECORDS[0],
        RECORDS[57],
        RECORDS[1],
        RECORDS[59],
    ]
    # no sidecar behind the user's back
    assert not files[0].exists(f"{BUCKET}/train-0.tfrecord.idx")


def test_a_read_cut_half_way_is_retried_from_where_it_was(files):
    fs, proxy = files
    url = f"s3://{BUCKET}/train-0.tfrecord"
    proxy.arm(allow=300_000, cuts=1)
    got = list(
        tp.TFRecordDataset(
            url, buffer_size=64 * 1024, retry=tp.io.RetryPolicy(attempts=3, backoff_s=0.01)
        )
    )
    assert got == RECORDS[0::3] and proxy.cut == 1


def test_a_read_that_keeps_failing_names_the_url_and_byte(files):
    fs, proxy = files
    url = f"s3://{BUCKET}/train-1.tfrecord"
    proxy.arm(allow=300_000, cuts=10**6)
    it = iter(
        tp.TFRecordDataset(
            url, buffer_size=64 * 1024, retry=tp.io.RetryPolicy(attempts=2, backoff_s=0.01)
        )
    )
    got = []
    with pytest.raises(
        tp.io.RemoteReadError, match=f"reading {url} failed at byte [0-9]+ after 2 attempt"
    ) as info:
        for record in it:
            got.append(record)
    proxy.arm(allow=0, cuts=0)  # the network is back
    assert info.value.url == url and 0 < info.value.offset < fs.size(f"{BUCKET}/train-1.tfrecord")
    assert got == RECORDS[1::3][: len(got)] and 0 < len(got) < 20
    state = it.state_dict()
    resumed = iter(tp.TFRecordDataset(url))
    resumed.load_state_dict(state)
    assert list(resumed) == []  # the failed file was given up, as after a corrupt record


def test_webdataset_shards_on_s3(files):
    for k in range(2):
        with tp.io.TarWriter(f"s3://{BUCKET}/shard-{k:03d}.tar") as writer:
            for i in range(3):
                writer.write({"__key__": f"{k}-{i}", "txt": f"s{k} {i}"})
    samples = list(tp.from_webdataset(f"s3://{BUCKET}/shard-{{000..001}}.tar", decode=True))
    assert [s["txt"] for s in samples] == ["s0 0", "s0 1", "s0 2", "s1 0", "s1 1", "s1 2"]
    assert samples[0]["__url__"] == f"s3://{BUCKET}/shard-000.tar"


def test_missing_fsspec_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    with pytest.raises(
        ImportError, match=r"opening s3://b/x needs fsspec: pip install 'torchpipe\[remote\]'"
    ):
        list(tp.TFRecordDataset("s3://b/x"))


def test_retry_policy_checks_its_arguments():
    with pytest.raises(ValueError, match="attempts"):
        tp.io.RetryPolicy(attempts=0)
    assert tp.io.RetryPolicy(backoff_s=1, max_backoff_s=3).wait_s(5) == 3
