"""bench/train_transform.py's rows on a few small files: what each makes, and the report."""

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import torchpipe as tp
from bench import data
from bench import train_transform as tt

FILES = 8
BATCH = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Iterator[list[str]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(data.CACHE_ENV, str(tmp_path_factory.mktemp("bench-cache")))
        yield data.photo_jpeg_files(FILES)


def test_the_photo_files_are_imagenet_sized(files):
    for path in files:
        with Image.open(path) as image:
            assert (
                450 <= image.width <= 550 and 340 <= image.height <= 410 and image.format == "JPEG"
            )


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("workload", tt.WORKLOADS)
def test_the_tpimage_rows_make_normalized_training_batches(files, workload, fused):
    images, labels = next(iter(tt.tpimage(workload, files, BATCH, fused)))
    tt.check_batch((images, labels), BATCH)
    assert -2.2 < images.min() < 0 < images.max() < 2.7  # normalized, not [0, 1] or [0, 255]
    assert set(labels.tolist()) <= set(tt.labels_of(FILES))


def test_the_dataloader_rows_make_the_same_kind_of_batches(files):
    for batches in (tt.torch_dataloader(files, BATCH, 0), tt.tp_dataloader(files, BATCH)):
        batch = next(iter(batches))
        tt.check_batch(batch, BATCH)
        assert -2.2 < batch[0].min() < 0 < batch[0].max() < 2.7


@pytest.mark.parametrize("seed", [3, 4])
def test_the_pillow_transform_is_tp_images_on_the_same_window_and_flip(files, seed):
    with Image.open(files[0]) as image:
        rgb = image.convert("RGB")
    torch.manual_seed(seed)
    got = tt.PillowTrainTransform()(rgb)
    torch.manual_seed(seed)
    window_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    flipped = torch.rand(1).item() < 0.5
    want = tp.image.train_transform(
        files[0],
        tt.SIZE,
        tt.MEAN,
        tt.STD,
        rng=np.random.default_rng(window_seed),
        flip=float(flipped),
    )
    # Pillow's resize: within 1
    assert (got - want).abs().max().item() <= 1 / (255 * min(tt.STD)) + 1e-5


def test_the_rows_of_each_workload_and_what_is_missing():
    assert set(tt.builders("jpeg")) >= {
        "torchpipe_tpimage",
        "tp_dataloader_auto",
        "tfdata_native",
        "ffcv",
    }
    assert {r for r in tt.builders("jpeg") if r.startswith("torch_dataloader")} == {
        f"torch_dataloader_torchvision_w{n}" for n in tt.TORCH_WORKERS
    }
    assert set(tt.builders("tfrecord")) == {
        "torchpipe_tpimage",
        "torchpipe_tpimage_unfused",
        "tfdata_native",
    }
    assert tt.missing("torchpipe_tpimage") is None
    assert (tt.missing("ffcv") is None) == (importlib.util.find_spec("ffcv") is not None)


def test_check_batch_refuses_a_batch_of_another_shape_or_dtype():
    with pytest.raises(AssertionError):
        tt.check_batch((torch.zeros(BATCH, 3, 224, 224, dtype=torch.uint8), [0] * BATCH), BATCH)
    with pytest.raises(AssertionError):
        tt.check_batch((torch.zeros(BATCH, 3, 200, 224), [0] * BATCH), BATCH)


def test_the_table_gives_ratios_to_tf_data_and_torchs_best_and_says_what_did_not_run():
    rows = {
        "torchpipe_tpimage": {"img_s": 300.0, "cpu_ms": 1.5},
        "torch_dataloader_torchvision_w2": {"img_s": 100.0, "cpu_ms": 3.0},
        "torch_dataloader_torchvision_w4": {"img_s": 150.0, "cpu_ms": 3.1},
        "tfdata_native": {"img_s": 200.0, "cpu_ms": 1.9},
        "ffcv": {"not_run": "ffcv is not installed"},
    }
    text = tt.table("jpeg", rows)
    assert "| torchpipe_tpimage | 300 | 1.50 | 1.50x | 2.00x |" in text
    assert "| ffcv | not run: ffcv is not installed |" in text
    assert tt.summary(
        [{"img_s": 1.0, "cpu_ms": 2.0}, {"error": "x"}, {"img_s": 3.0, "cpu_ms": 4.0}]
    ) == {
        "img_s": 2.0,
        "cpu_ms": 3.0,
        "runs": 2,
        "spread": 2.0,
    }
    assert "| torchpipe_tpimage | 300 (spread 10%) |" in tt.table(
        "jpeg", {"torchpipe_tpimage": {"img_s": 300.0, "cpu_ms": 1.5, "spread": 0.1}}
    )


@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed"
)
@pytest.mark.parametrize("workload", tt.WORKLOADS)
def test_the_tf_data_row_runs_in_a_fresh_process(files, workload):
    script = Path(tt.__file__).resolve()
    command = [
        sys.executable,
        str(script),
        "--one",
        "tfdata_native",
        "--workload",
        workload,
        "--files",
        str(FILES),
        "--batch-size",
        str(BATCH),
        "--warmup",
        "1",
        "--batches",
        "1",
    ]
    env = {**os.environ, data.CACHE_ENV: str(Path(files[0]).parent.parent)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=50, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # one batch, maybe prefetched: CPU ticks of 10 ms may read 0
    assert result["img_s"] > 0 and result["cpu_ms"] >= 0
