"""JPEG decoders measured side by side (issue #34): which codec ``tp.image`` builds on.

Each candidate turns the bench's JPEG files (``bench/data.py``, ~320 px, quality 90) into uint8
RGB HWC arrays. Per candidate, on this machine:

- **CPU ms**: CPU time per image, one thread, files already in memory; and at half the size,
  decoded at a reduced DCT scale where the decoder can (what a crop shrinking 2x or more needs);
- **GIL held**: the share of a decode during which the GIL is held, from how much a pure-Python
  counting loop on the main thread slows while a second thread decodes (0: it never waits for the
  decoder; 1: it stops while decoding);
- **img/s, 1 and 2 threads**: decodes of the same bytes, on a thread pool of that size;
- **max diff**: the largest difference in a pixel value from Pillow's decode of the same file;

and, on JPEG kinds real data sets hold (grayscale, CMYK, progressive, EXIF-rotated, truncated),
what each gives against Pillow's RGB decode, or the error it raises.

A candidate that is not installed (or lacks its system library) is reported with the reason.
Run: ``python bench/jpeg_decoders.py [--files N] [--seconds S] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: import the bench package from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import data

Decoder = Callable[[bytes], np.ndarray]


def _pillow() -> Decoder:
    from PIL import Image

    def decode(raw: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(raw)) as image:
            return np.asarray(image.convert("RGB"))

    return decode


def _simplejpeg() -> Decoder:
    import simplejpeg

    return lambda raw: simplejpeg.decode_jpeg(raw, colorspace="RGB")


def _opencv() -> Decoder:
    import cv2

    cv2.setNumThreads(1)  # one decode a thread, as the others

    def decode(raw: bytes) -> np.ndarray:
        bgr = cv2.imdecode(np.frombuffer(raw, np.uint8), cv2.IMREAD_COLOR)
        return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)

    return decode


def _pyturbojpeg() -> Decoder:
    from turbojpeg import TJPF_RGB, TurboJPEG

    codec = TurboJPEG()  # raises where the system libturbojpeg is missing
    return lambda raw: codec.decode(raw, pixel_format=TJPF_RGB)


def _pillow_half() -> Decoder:
    from PIL import Image

    def decode(raw: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(raw)) as image:
            image.draft("RGB", (image.width // 2, image.height // 2))  # the DCT scaled by 1/2
            return np.asarray(image.convert("RGB"))

    return decode


def _simplejpeg_half() -> Decoder:
    import simplejpeg

    def decode(raw: bytes) -> np.ndarray:
        height, width, _, _ = simplejpeg.decode_jpeg_header(raw)  # min_factor alone does not scale
        return simplejpeg.decode_jpeg(
            raw, colorspace="RGB", min_height=height // 2, min_width=width // 2
        )

    return decode


def _opencv_half() -> Decoder:
    import cv2

    cv2.setNumThreads(1)
    return lambda raw: cv2.cvtColor(
        cv2.imdecode(np.frombuffer(raw, np.uint8), cv2.IMREAD_REDUCED_COLOR_2), cv2.COLOR_BGR2RGB
    )


HALF: dict[str, Callable[[], Decoder]] = {
    "pillow": _pillow_half,
    "simplejpeg": _simplejpeg_half,
    "opencv-headless": _opencv_half,
}
"""Decoders at half the size, by the DCT's scaling (what a crop that shrinks by 2x or more needs)."""

CANDIDATES: dict[str, Callable[[], Decoder]] = {
    "pillow": _pillow,
    "simplejpeg": _simplejpeg,
    "opencv-headless": _opencv,
    "pyturbojpeg": _pyturbojpeg,
}


def cpu_ms(decode: Decoder, blobs: list[bytes], seconds: float) -> float:
    """CPU milliseconds per decode on this thread."""
    start, cpu0, n = time.perf_counter(), time.thread_time(), 0
    while n == 0 or time.perf_counter() - start < seconds:  # one at least, on a busy machine too
        decode(blobs[n % len(blobs)])
        n += 1
    return (time.thread_time() - cpu0) / n * 1e3


def _count_for(seconds: float) -> float:
    """Pure-Python loop iterations per second on this thread."""
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for _ in range(1000):
            pass
        n += 1000
    return n / (time.perf_counter() - start)


def gil_held(decode: Decoder, blobs: list[bytes], seconds: float) -> float:
    """The share of a decode that holds the GIL: how much a counting loop slows beside it."""
    alone = _count_for(seconds)
    stop = threading.Event()

    def decoding() -> None:
        n = 0
        while not stop.is_set():
            decode(blobs[n % len(blobs)])
            n += 1

    thread = threading.Thread(target=decoding, daemon=True)
    thread.start()
    try:
        beside = _count_for(seconds)
    finally:
        stop.set()
        thread.join()
    return min(1.0, max(0.0, 1.0 - beside / alone))


def throughput(decode: Decoder, blobs: list[bytes], threads: int, seconds: float) -> float:
    """Images per second decoded by ``threads`` threads."""
    stop = time.perf_counter() + seconds
    counts = [0] * threads

    def worker(k: int) -> None:
        # at least one decode a thread: on a busy machine a thread may start after the window
        n = k
        while True:
            decode(blobs[n % len(blobs)])
            n += threads
            counts[k] += 1
            if time.perf_counter() >= stop:
                return

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    return sum(counts) / (time.perf_counter() - start)


def max_diff(decode: Decoder, reference: Decoder, blobs: list[bytes]) -> int:
    """The largest difference in one pixel value from ``reference``'s decode."""
    worst = 0
    for raw in blobs:
        got, want = decode(raw), reference(raw)
        if got.shape != want.shape:
            return 255
        worst = max(worst, int(np.abs(got.astype(np.int16) - want.astype(np.int16)).max()))
    return worst


def measure(files: int, seconds: float) -> dict[str, dict[str, object]]:
    """Every candidate's figures (or why it was not measured), by name."""
    blobs = [Path(p).read_bytes() for p in data.jpeg_files(files)]
    reference = _pillow()
    results: dict[str, dict[str, object]] = {}
    for name, make in CANDIDATES.items():
        try:
            decode = make()
            decode(blobs[0])
        except Exception as e:  # noqa: BLE001 - reported: not installed, or its library missing
            results[name] = {"not_measured": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
            continue
        results[name] = {
            "cpu_ms": round(cpu_ms(decode, blobs, seconds), 3),
            "gil_held": round(gil_held(decode, blobs, seconds), 2),
            "img_s_1_thread": round(throughput(decode, blobs, 1, seconds)),
            "img_s_2_threads": round(throughput(decode, blobs, 2, seconds)),
            "max_diff_vs_pillow": max_diff(decode, reference, blobs[:64]),
        }
        if name in HALF:
            results[name]["cpu_ms_half_scale"] = round(cpu_ms(HALF[name](), blobs, seconds), 3)
    return results


def messy_files() -> dict[str, bytes]:
    """The JPEG kinds real data sets hold besides baseline RGB, made with Pillow from one image:
    grayscale, CMYK, progressive, EXIF-rotated (orientation 6) and truncated (half the bytes)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize(
        (96, 64), Image.BICUBIC
    )
    image = Image.fromarray(np.asarray(coarse))

    def save(picture: Image.Image, **options: object) -> bytes:
        out = io.BytesIO()
        picture.save(out, "JPEG", quality=90, **options)
        return out.getvalue()

    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display
    rgb = save(image)
    return {
        "rgb": rgb,
        "grayscale": save(image.convert("L")),
        "cmyk": save(image.convert("CMYK")),
        "progressive": save(image, progressive=True),
        "exif-rotated": save(image, exif=exif.tobytes()),
        "truncated": rgb[: len(rgb) // 2],
    }


def robustness() -> dict[str, dict[str, str]]:
    """Each installed candidate on each of :func:`messy_files`: the shape it gives and its largest
    difference from Pillow's RGB, or the error it raises; by file kind, then decoder."""
    reference = _pillow()
    out: dict[str, dict[str, str]] = {}
    for kind, raw in messy_files().items():
        try:
            want: np.ndarray | None = reference(raw)
        except Exception:  # noqa: BLE001 - a file Pillow rejects: shapes only
            want = None
        row = {}
        for name, make in CANDIDATES.items():
            try:
                got = make()(raw)
            except Exception as e:  # noqa: BLE001 - reported: the candidate's error (or its absence)
                row[name] = f"error: {type(e).__name__}"
                continue
            if want is None or got.shape != want.shape:
                row[name] = f"{got.shape[1]}x{got.shape[0]}" + (
                    "" if want is None else f" (Pillow {want.shape[1]}x{want.shape[0]})"
                )
            else:
                row[name] = (
                    f"max diff {int(np.abs(got.astype(np.int16) - want.astype(np.int16)).max())}"
                )
        out[kind] = row
    return out


def table(results: dict[str, dict[str, object]]) -> str:
    """The results as a markdown table."""
    lines = [
        "| decoder | CPU ms/image | at 1/2 scale | GIL held | img/s, 1 thread | img/s, 2 threads | "
        "max diff vs Pillow |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "not_measured" in r:
            lines.append(f"| {name} | not measured: {r['not_measured']} | | | | | |")
            continue
        lines.append(
            f"| {name} | {r['cpu_ms']} | {r.get('cpu_ms_half_scale', '-')} | {r['gil_held']} | "
            f"{r['img_s_1_thread']} | {r['img_s_2_threads']} | {r['max_diff_vs_pillow']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--files", type=int, default=256, help="JPEG files decoded (the bench's own)"
    )
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds per figure")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = measure(args.files, args.seconds)
    print(table(results))
    messy = robustness()
    names = list(CANDIDATES)
    print("\n| file | " + " | ".join(names) + " |\n|---" * 1 + "|---" * len(names) + "|")
    for kind, row in messy.items():
        print(f"| {kind} | " + " | ".join(row[n] for n in names) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"speed": results, "files": messy}, indent=1))


if __name__ == "__main__":
    main()
