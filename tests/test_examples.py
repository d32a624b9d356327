"""The image examples run end to end on small data."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("loader", [False, True])
def test_imagenet_style_trains_from_an_image_folder(tmp_path, capsys, loader):
    imagenet = example("imagenet_style")
    imagenet.make_folder(str(tmp_path), classes=2, per_class=8)
    assert len(imagenet.samples(str(tmp_path))) == 16
    imagenet.main(
        [
            "--root",
            str(tmp_path),
            "--steps",
            "3",
            "--batch-size",
            "4",
            *(["--loader"] if loader else []),
        ]
    )
    out = capsys.readouterr().out
    assert "12 images in" in out and "0 of them by Pillow" in out


def test_tfrecord_images_reads_examples_from_shards(tmp_path, capsys):
    tfrecord = example("tfrecord_images")
    pattern = tfrecord.write_shards(str(tmp_path), shards=2, per_shard=16)
    tfrecord.main(["--files", pattern, "--epochs", "1", "--batch-size", "8"])
    out = capsys.readouterr().out
    assert "epoch 0: 32 images" in out and "32 decoded by tp.image" in out
