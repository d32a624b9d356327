"""The docs run: every ```python block of README.md and docs/*.md, and every relative link.

Each block is one test (``docs/image.md:3`` is that page's third Python block), run in a fresh
folder holding small data (``data/``: a few JPEGs, TFRecord shards of Examples, WebDataset tar
shards) with the names a reader would have defined before copying it (``images``, ``augment``,
``model``, ...: see ``user_names``). An HTML comment on the line before a block's fence says how
it runs:

- ``<!-- continues -->``: after the block above it on the page, in the same namespace
  (``<!-- continues: 1 -->``: after the page's first block);
- ``<!-- requires: torchvision -->``: skipped where that module cannot be imported;
- ``<!-- cuda as cpu -->``: without CUDA, ``"cuda"`` in the block is read as ``"cpu"`` (a
  documented no-op: the block runs as written but for the copy to the GPU);
- ``<!-- one rank -->``: inside a ``torch.distributed`` process group of one rank (gloo);
- ``<!-- not run: REASON -->``: never run here (a cluster, a cloud bucket); reported as skipped.

Bash and other blocks are not run.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image

import torchpipe as tp

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(
    r"^<!--\s*(continues|requires|cuda as cpu|one rank|not run)\s*:?\s*(.*?)\s*-->\s*$"
)
IMAGES, SAMPLES, SHARDS, SHARD_RECORDS, TARS = 16, 256, 2, 8, 4


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its code, and what its markers say."""

    page: str
    number: int
    line: int
    code: str
    markers: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return f"{self.page}:{self.number}"

    def marker(self, kind: str) -> str | None:
        """The text of this block's marker of that kind ("" where it has none), else None."""
        return next((text for k, text in self.markers if k == kind), None)


def page_blocks(path: Path) -> list[Block]:
    """The Python blocks of one page, numbered from 1, with the markers just above each."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if fence.group(1) == "python":
            markers = []
            k = i - 1
            while k >= 0 and (m := MARKER.match(lines[k])):
                markers.append((m.group(1), m.group(2)))
                k -= 1
            code = "\n".join(lines[i + 1 : end])
            blocks.append(
                Block(
                    path.relative_to(ROOT).as_posix(), len(blocks) + 1, i + 2, code, tuple(markers)
                )
            )
        i = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in page_blocks(page)]


def chain(block: Block) -> list[Block]:
    """The block and those it continues, first to last."""
    same_page = [b for b in BLOCKS if b.page == block.page]
    blocks = [block]
    while (after := blocks[0].marker("continues")) is not None:
        blocks.insert(0, same_page[int(after) - 1 if after else blocks[0].number - 2])
    return blocks


# --- small data and the names a reader defines -------------------------------------------------


def jpeg(i: int, size: tuple[int, int] = (40, 32)) -> bytes:
    """A small photo-like JPEG: a smooth random colour field."""
    coarse = np.random.default_rng(i).integers(0, 256, size=(3, 3, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(coarse).resize(size, Image.BICUBIC).save(out, "JPEG", quality=85)
    return out.getvalue()


def write_data(folder: Path) -> None:
    """``folder``: JPEGs, TFRecord shards of Examples (``image``, ``label``) and tar shards."""
    folder.mkdir()
    for i in range(IMAGES):
        (folder / f"img_{i:03d}.jpg").write_bytes(jpeg(i))
    for k in range(SHARDS):
        with tp.io.TFRecordWriter(
            str(folder / f"train-{k:05d}-of-{SHARDS:05d}.tfrecord")
        ) as writer:
            for i in range(SHARD_RECORDS):
                writer.write(tp.io.serialize_example({"image": jpeg(k * 100 + i), "label": i % 10}))
    for k in range(TARS):
        with tp.io.TarWriter(str(folder / f"shard-{k:06d}.tar")) as writer:
            for i in range(3):
                writer.write({"__key__": f"s{k}_{i}", "jpg": jpeg(k * 10 + i), "cls": i})


class EncodedImages(torch.utils.data.Dataset):
    """A map-style dataset of (JPEG bytes, label) pairs, the files of ``data/`` read again and
    again up to ``length`` samples."""

    def __init__(self, paths: list[str], length: int) -> None:
        self.paths, self.length = paths, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        if not 0 <= i < self.length:
            raise IndexError(i)
        return Path(self.paths[i % len(self.paths)]).read_bytes(), i % 10


class Vectors(torch.utils.data.Dataset):
    """A map-style dataset of (float vector, label) pairs: a DataLoader's ``dataset``."""

    def __len__(self) -> int:
        return 300

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < 300:
            raise IndexError(i)
        return torch.full((8,), float(i)), i % 10


def decode(data: bytes, label: int) -> tuple[torch.Tensor, int]:
    """A JPEG's pixels, resized to 32 x 32 so that a batch stacks."""
    return tp.image.resize(tp.image.decode_jpeg(data), (32, 32)), label


def augment(data: bytes, label: int) -> tuple[torch.Tensor, int]:
    """Decode, random resized crop to 32 px, random flip, normalize."""
    image = tp.image.random_flip_left_right(tp.image.decode_and_random_resized_crop(data, 32))
    return tp.image.to_tensor(image), label


def decode_and_crop(data: bytes) -> torch.Tensor:
    """A JPEG's central 24 x 24 pixels, as floats."""
    return tp.image.to_tensor(tp.image.center_crop(tp.image.decode_jpeg(data), 24))


class TinyModel(torch.nn.Module):
    """A linear classifier of any input, pooled to 8 features: the reader's ``model``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.adaptive_avg_pool1d(x.flatten(1).float().unsqueeze(1), 8)
        return self.linear(pooled.squeeze(1))


def train_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """One SGD step of ``model`` on a batch; the loss."""
    loss = torch.nn.functional.cross_entropy(model(x.float()), torch.as_tensor(y))
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
    return float(loss.detach())


def user_names(folder: Path) -> dict[str, Any]:
    """What a reader has defined before a block: the imports every page assumes (``tp``,
    ``torch``) and small versions of the data, functions and model the blocks name."""
    write_data(folder / "data")
    files = sorted(str(p) for p in (folder / "data").glob("img_*.jpg"))
    paths = [files[i % len(files)] for i in range(SAMPLES)]  # a batch of 256 (drop_remainder=True)
    spec = {
        "image": tp.io.FixedLenFeature([], bytes),
        "label": tp.io.FixedLenFeature([], torch.int64),
    }

    def parse_fn(record: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        example = tp.io.parse_single_example(record, spec)
        return decode_and_crop(example["image"]), example["label"]

    model = TinyModel()
    return {
        "__name__": "__docs__",
        "tp": tp,
        "torch": torch,
        "epochs": 2,
        "images": EncodedImages(files, SAMPLES),
        "dataset": Vectors(),
        "train": Vectors(),
        "paths": paths,
        "labels": [i % 10 for i in range(len(paths))],
        "samples": [(p, i % 10) for i, p in enumerate(paths)],
        "augment": augment,
        "decode": decode,
        "decode_and_augment": augment,
        "decode_and_crop": decode_and_crop,
        "parse_fn": parse_fn,
        "ds": tp.from_dataset(Vectors()).batch(64),
        "pipeline": tp.from_dataset(Vectors()).map(lambda x, y: (x + 1, y)),
        "loader": tp.DataLoader(Vectors(), batch_size=64, num_workers="auto"),
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
        "train_step": train_step,
        "base": tp.range(40),
        "f": lambda x: x * 2,
    }


# --- the tests ---------------------------------------------------------------------------------


@pytest.fixture
def restore_sigterm() -> Iterator[None]:
    """Puts back the SIGTERM handler a block installs (the preemption recipe sets one)."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


def run(block: Block, namespace: dict[str, Any]) -> None:
    """Runs one block in ``namespace``, its tracebacks naming the page and the page's lines;
    then iterates the pipelines and loaders it made and left unused, as its reader would next."""
    code = block.code
    if block.marker("cuda as cpu") is not None and not torch.cuda.is_available():
        code = code.replace('"cuda"', '"cpu"')
    before = dict(namespace)
    exec(compile("\n" * (block.line - 1) + code, block.page, "exec"), namespace)
    for name, value in namespace.items():
        if before.get(name) is not value and isinstance(
            value, (tp.Dataset, torch.utils.data.DataLoader)
        ):
            for _ in itertools.islice(value, 100):
                pass


@contextlib.contextmanager
def one_rank(folder: Path) -> Iterator[None]:
    """A ``torch.distributed`` process group of this process alone (gloo), for the time of a block."""
    dist.init_process_group("gloo", init_method=(folder / "group").as_uri(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.usefixtures("restore_sigterm")
def test_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reason = block.marker("not run")
    if reason is not None:
        pytest.skip(f"not run: {reason}")
    blocks = chain(block)
    for module in {
        m.strip() for b in blocks for m in (b.marker("requires") or "").split(",") if m.strip()
    }:
        pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)
    namespace = user_names(tmp_path)
    group = (
        one_rank(tmp_path)
        if any(b.marker("one rank") is not None for b in blocks)
        else contextlib.nullcontext()
    )
    with group:
        for b in blocks:
            run(b, namespace)


def test_blocks_are_found_and_their_markers_known() -> None:
    # A typo in a marker would silently run (or not run) a block; a marker must sit above a fence.
    assert len(BLOCKS) >= 20 and all(b.code.strip() for b in BLOCKS)
    assert [str(b) for b in BLOCKS if b.page == "README.md"][:2] == ["README.md:1", "README.md:2"]
    for page in PAGES:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            if line.startswith("<!--") and MARKER.match(line):
                below = next(x for x in lines[n + 1 :] if not MARKER.match(x))
                assert below == "```python", (
                    f"{page.name}:{n + 1}: a marker not above a Python block"
                )
    for block in BLOCKS:
        after = block.marker("continues")
        assert after is None or 0 < int(after or block.number - 1) < block.number, (
            f"{block} continues nothing"
        )


def test_every_block_compiles() -> None:
    # Blocks that are not run here (or skipped for a missing module) are still Python.
    for block in BLOCKS:
        compile(block.code, str(block), "exec")


def test_a_pipeline_a_block_leaves_is_iterated() -> None:
    # docs/image.md's first block once built a pipeline whose map function took one argument:
    # building it passed, its first element raised, so the test iterates what a block leaves.
    block = Block(
        "example.md", 1, 2, "ds = tp.from_tensor_slices(([1, 2], [3, 4])).map(lambda pair: pair)"
    )
    with pytest.raises(TypeError, match="positional argument"):
        run(block, {"tp": tp})


def test_the_readme_stays_under_300_lines() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 300, (
        f"README.md has {lines} lines: move the details to a page of docs/ and link it"
    )


def test_few_blocks_are_not_run() -> None:
    not_run = [f"{b}: {b.marker('not run')}" for b in BLOCKS if b.marker("not run") is not None]
    assert len(not_run) <= len(BLOCKS) // 4, "\n".join(not_run)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(
    r"(?<![\w./{-])((?:docs|bench|examples|tests|torchpipe)/[\w./-]*\w)(?![\w./<-])"
)  # not test_<op>.py


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to dashes."""
    heads = [
        line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")
    ]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_and_paths_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # paths in code are examples
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file) if file else page
        if not resolved.exists() or (
            anchor and resolved.suffix == ".md" and anchor not in anchors(resolved)
        ):
            broken.append(target)
    for path in PATH.findall(text):
        if not (ROOT / path).exists() and not (page.parent / path).exists():
            broken.append(path)
    assert not broken, f"{page.name}: {broken}"
