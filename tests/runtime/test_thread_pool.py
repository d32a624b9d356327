import gc
import threading
import time

import pytest

from torchpipe.runtime.thread_pool import ThreadPool


def alive(prefix):
    return sum(t.name.startswith(prefix + "-") for t in threading.enumerate())


def wait_alive(prefix, count, timeout=5.0):
    deadline = time.monotonic() + timeout
    while alive(prefix) != count and time.monotonic() < deadline:
        time.sleep(0.02)
    return alive(prefix)


def test_runs_calls_and_carries_exceptions():
    pool = ThreadPool(2, "calls")
    assert pool.submit(pow, 2, 5).result(5) == 32
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    pool.close()


def test_resize_and_close_stop_threads():
    pool = ThreadPool(3, "resize")
    assert alive("resize") == 3
    pool.resize(1)
    assert wait_alive("resize", 1) == 1 and pool.size == 1
    pool.resize(2)
    assert wait_alive("resize", 2) == 2
    pool.close()
    assert wait_alive("resize", 0) == 0
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(abs, 1)
    with pytest.raises(ValueError):
        ThreadPool(0, "bad")


def test_collected_pool_stops_its_threads():
    pool = ThreadPool(2, "collected")
    assert alive("collected") == 2
    del pool
    gc.collect()
    assert wait_alive("collected", 0) == 0


def test_close_cancels_queued_calls():
    gate, started = threading.Event(), threading.Event()

    def hold():
        started.set()
        return gate.wait(5)

    pool = ThreadPool(1, "cancel")
    running = pool.submit(hold)
    queued = pool.submit(abs, -1)
    assert started.wait(5)
    pool.close()
    gate.set()
    assert running.result(5) is True and queued.cancelled()


def test_close_waits_for_running_calls():
    pool = ThreadPool(2, "tp-join")
    done, started = [], threading.Semaphore(0)

    def call():
        started.release()
        time.sleep(0.2)
        done.append(1)

    futures = [pool.submit(call) for _ in range(2)]
    for _ in range(2):  # both calls are running (on a loaded machine a thread starts late)
        assert started.acquire(timeout=10)
    pool.close()
    assert done == [1, 1] and all(f.done() for f in futures)
    assert alive("tp-join") == 0


EXIT_SCRIPT = """
import torch, torchpipe as tp
def crop(i):
    return torch.from_numpy(torch.rand(3, 64, 64).numpy()[:, ::-1].copy())
it = iter(tp.range(10**6).map(crop, num_parallel_calls=2, executor="thread").batch(64))
next(it)
"""


def test_exiting_with_a_pipeline_running_does_not_abort(tmp_path):
    """Pool threads inside torch ops while the interpreter exits used to abort it ("terminate
    called without an active exception", exit status 134)."""
    import os
    import subprocess
    import sys

    import torchpipe

    script = tmp_path / "exit_running.py"
    script.write_text(EXIT_SCRIPT)
    root = os.path.dirname(os.path.dirname(torchpipe.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    runs = [
        subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, env=env)
        for _ in range(3)
    ]
    for run in runs:
        _, err = run.communicate(timeout=50)
        assert run.returncode == 0, err.decode()


def test_pool_threads_use_one_intra_op_thread_and_leave_the_others_alone():
    """Side-by-side torch ops in pool threads must not each start an OpenMP team of all cores;
    the main thread and threads started later keep torch's setting."""
    import torch

    before = torch.get_num_threads()
    if before == 1:
        pytest.skip("torch already uses one intra-op thread here")
    pool = ThreadPool(2, "tp-intra")
    try:
        assert [pool.submit(torch.get_num_threads).result(timeout=5) for _ in range(4)] == [1] * 4
    finally:
        pool.close()
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert torch.get_num_threads() == before
    assert later == [before]
