"""CPU time an image of the ``jpeg`` workload's fixed-crop rows, part by part (issue #61).

``torchpipe_tpimage`` (``bench/tpimage.py``) is held to ``tfdata_native`` (``bench/tfdata.py``):
both decode with libjpeg-turbo's fast integer IDCT on the same cores, so what separates them is
the CPU each spends around the decode. Each part below is measured in CPU time (user and system
time of every thread of the process and of its worker processes: a busy machine's other processes
do not inflate it) over ``--images`` images after ``--warmup`` images, in a fresh process, the
parts alternating (A B C ... A B C ...) ``--repeat`` times; the median is printed, in
microseconds an image:

- ``simplejpeg``: ``simplejpeg.decode_jpeg`` of the file's bytes (read in the loop), the floor;
- ``decode``: ``tp.image.decode_jpeg(path, fast_dct=True)``;
- ``augment``: ``tpimage.crop_and_flip`` of images decoded beforehand, in an inline map;
- ``item``: ``tpimage.JpegItem`` in an inline map (decode, crop, flip, CHW), unbatched;
- ``inline``: the same, batched by 64, all on the main thread;
- ``threads``, ``processes``: the same on 2 threads or 2 worker processes, prefetched;
- ``tpimage``: the bench's row as it builds it (``tpimage.batched``: AUTOTUNE, prefetch);
- ``tfdata``: tf.data's native pipeline as the bench builds it (``tfdata._native_jpeg``).

Run: ``python bench/fixed_crop_cpu.py [--parts ...] [--images 2048] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BATCH = 64
PARTS = (
    "simplejpeg",
    "decode",
    "augment",
    "item",
    "inline",
    "threads",
    "processes",
    "tpimage",
    "tfdata",
)


def _paths() -> list[str]:
    """The ``jpeg`` workload's files, as ``--quick`` makes them."""
    from bench import data
    from bench import workloads as wl

    return data.jpeg_files(wl.QUICK.jpeg_files)


def _images(part: str, paths: list[str], where: dict[str, str]) -> Iterator[int]:
    """The ``simplejpeg`` and ``decode`` loops: one image a step."""
    import simplejpeg

    import torchpipe as tp

    def simple() -> Iterator[int]:
        for i in range(10**9):
            with open(paths[i % len(paths)], "rb") as f:
                simplejpeg.decode_jpeg(f.read(), fastdct=True)
            yield 1

    def decode() -> Iterator[int]:
        for i in range(10**9):
            tp.image.decode_jpeg(paths[i % len(paths)], fast_dct=True)
            yield 1

    return simple() if part == "simplejpeg" else decode()


def _dataset(part: str, paths: list[str], where: dict[str, str]) -> Iterator[int]:
    """A pipeline's elements (or batches) as the number of images in each; where its work ran goes
    in ``where`` once it is left (the inline parts run with one intra-op thread, as pool threads
    and worker processes do)."""
    import torch

    import torchpipe as tp
    from bench import tpimage
    from bench.measure import placement

    if part == "augment":
        decoded = [tp.image.decode_jpeg(p, fast_dct=True) for p in paths[:256]]
        ds = tp.range(10**9).map(lambda i: tpimage.crop_and_flip(decoded[i % len(decoded)]))
    elif part == "item":
        ds = tp.range(10**9).map(tpimage.JpegItem(paths))
    elif part == "inline":
        ds = tp.range(10**9).map(tpimage.JpegItem(paths)).batch(BATCH)
    elif part in ("threads", "processes"):
        executor = part[:-1] if part == "threads" else "process"
        ds = tp.range(10**9).map(tpimage.JpegItem(paths), num_parallel_calls=2, executor=executor)
        ds = ds.batch(BATCH).prefetch(tp.AUTOTUNE)
    else:
        ds = tpimage.batched(SimpleNamespace(name="jpeg", files=paths, batch_size=BATCH))  # type: ignore[arg-type]
    if part in ("augment", "item", "inline"):
        torch.set_num_threads(1)
    iterator = iter(ds)
    try:
        for element in iterator:
            yield 1 if part in ("augment", "item") else len(element[0])
    finally:
        where["where"] = (placement(None, iterator) or {}).get("where") or "?"


def _tfdata(part: str, paths: list[str], where: dict[str, str]) -> Iterator[int]:
    from bench import tfdata

    for batch in tfdata._native_jpeg(paths, BATCH, 10**9):
        yield int(batch[0].shape[0])


def measure(part: str, images: int, warmup: int) -> tuple[float, str]:
    """CPU microseconds an image of ``part`` in this process and its children, and where a
    torchpipe pipeline ran its work."""
    make: Callable[[str, list[str], dict[str, str]], Iterator[int]] = (
        _images if part in ("simplejpeg", "decode") else _tfdata if part == "tfdata" else _dataset
    )
    where = {"where": ""}
    steps = make(part, _paths(), where)
    done = 0
    while done < warmup:
        done += next(steps)
    done, cpu0 = 0, tree_cpu()
    while done < images:
        done += next(steps)
    cpu = tree_cpu() - cpu0
    steps.close()  # type: ignore[attr-defined]
    return cpu / done * 1e6, where["where"]


def tree_cpu() -> float:
    """CPU seconds of this process and its children (a pipeline's worker processes): the live
    ones' so far, and those of the ones that ended and were waited for."""
    me = psutil.Process()
    ended = os.times()
    total = ended.children_user + ended.children_system
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this part
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.images, args.warmup)))
        return
    runs: dict[str, list[float]] = {part: [] for part in args.parts}
    wheres: dict[str, list[str]] = {part: [] for part in args.parts}
    for _ in range(args.repeat):
        for part in args.parts:
            us, where = _child(part, args.images, args.warmup)
            runs[part].append(us)
            wheres[part].append(where)
    for part, values in runs.items():
        spread = ", ".join(f"{v:.0f}" for v in values)
        ran = ", ".join(sorted(set(wheres[part]) - {""}))
        print(f"{part:>10}  {statistics.median(values):7.0f} us/image  ({spread})  {ran}")
    if "tpimage" in runs and "tfdata" in runs:
        ratio = statistics.median(runs["tpimage"]) / statistics.median(runs["tfdata"])
        print(f"tpimage / tfdata CPU an image: {ratio:.3f}x")


def _child(part: str, images: int, warmup: int) -> tuple[float, str]:
    command = [sys.executable, os.path.abspath(__file__), "--one", part]
    command += ["--images", str(images), "--warmup", str(warmup)]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    us, where = json.loads(out.strip().splitlines()[-1])
    return float(us), str(where)


if __name__ == "__main__":
    main()
