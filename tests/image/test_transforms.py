"""``tp.image`` geometry and conversion: Pillow's and torchvision's results, the window's
distribution, errors, and the same output on every executor."""

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

import torchpipe as tp
from tests.image.conftest import encode, photo
from torchpipe.image.resized_crop import dct_scale

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def image(height=60, width=80, seed=0) -> torch.Tensor:
    return torch.from_numpy(photo(height, width, seed))


def test_crops_are_views_inside_the_image():
    img = image()
    assert torch.equal(tp.image.crop(img, 3, 4, 10, 20), img[3:13, 4:24])
    assert torch.equal(tp.image.center_crop(img, (20, 30)), img[20:40, 25:55])
    with pytest.raises(ValueError, match="not inside the 60x80 image"):
        tp.image.crop(img, 55, 0, 10, 10)
    out = tp.image.random_crop(img, 32, rng=np.random.default_rng(1))
    assert out.shape == (32, 32, 3)
    places = {tuple(int(v) for v in torch.nonzero(img == out[0, 0])[0][:2]) for _ in range(1)}
    assert places  # found in the image
    with pytest.raises(ValueError, match="smaller"):
        tp.image.random_crop(img, (61, 10))
    with pytest.raises(TypeError, match="int or \\(height, width\\)"):
        tp.image.random_crop(img, (1, 2, 3))
    with pytest.raises(TypeError, match="height, width, channels"):
        tp.image.random_crop(img.permute(2, 0, 1)[0], 4)


def test_random_crop_places_are_uniform_and_repeat_with_the_generator():
    img = torch.arange(10 * 10).reshape(10, 10, 1)
    tops = [
        int(tp.image.random_crop(img, 8, rng=np.random.default_rng(s))[0, 0, 0]) // 10
        for s in range(300)
    ]
    assert set(tops) == {0, 1, 2}
    a = tp.image.random_crop(img, 5, rng=np.random.default_rng(7))
    assert torch.equal(a, tp.image.random_crop(img, 5, rng=np.random.default_rng(7)))


def test_outside_torchpipe_random_ops_follow_torchs_global_seed():
    img = torch.arange(20 * 20).reshape(20, 20, 1)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        first = [tp.image.random_crop(img, 5) for _ in range(4)]
        torch.manual_seed(3)
        again = [tp.image.random_crop(img, 5) for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert len({int(a[0, 0, 0]) for a in first}) > 1  # each call draws anew


def test_flips():
    img = image()
    assert torch.equal(tp.image.flip_left_right(img), img.flip(1))
    assert torch.equal(tp.image.random_flip_left_right(img, p=1.0), img.flip(1))
    assert tp.image.random_flip_left_right(img, p=0.0) is img
    with pytest.raises(ValueError, match="p must be"):
        tp.image.random_flip_left_right(img, p=2)


@pytest.mark.parametrize("size", [(30, 40), (45, 20), 24])
def test_resize_is_within_one_of_pillows_bilinear(size):
    img = image()
    out = tp.image.resize(img, size)
    h, w = (size, size * 80 // 60) if isinstance(size, int) else size
    assert out.shape == (h, w, 3) and out.dtype == torch.uint8
    expected = np.asarray(Image.fromarray(img.numpy()).resize((w, h), Image.BILINEAR))
    assert np.abs(out.numpy().astype(int) - expected).max() <= 1
    assert tp.image.resize(img, (60, 80)) is img
    floats = tp.image.resize(img.float(), size)
    assert floats.dtype == torch.float32 and (floats - out.float()).abs().max() <= 1


def test_to_tensor_and_normalize_are_torchvisions_formula():
    img = image()
    chw = img.permute(2, 0, 1).float() / 255
    assert torch.allclose(tp.image.to_tensor(img), chw)
    expected = (chw - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
    assert torch.allclose(tp.image.to_tensor(img, MEAN, STD), expected, atol=1e-5)
    assert torch.allclose(tp.image.normalize(img, MEAN, STD), expected, atol=1e-5)
    assert torch.allclose(tp.image.normalize(chw, MEAN, STD), expected, atol=1e-5)
    assert torch.allclose(tp.image.to_tensor(img, 0.5, 0.5), (chw - 0.5) / 0.5, atol=1e-5)
    assert tp.image.to_tensor(img, dtype=torch.float16).dtype == torch.float16
    with pytest.raises(ValueError, match="both mean and std"):
        tp.image.to_tensor(img, MEAN)
    with pytest.raises(ValueError, match="2 values for an image of 3 channels"):
        tp.image.to_tensor(img, (0.5, 0.5), (1.0, 1.0))
    with pytest.raises(ValueError, match="std must not be 0"):
        tp.image.normalize(img, MEAN, (1.0, 0.0, 1.0))


def test_the_window_is_drawn_as_torchvision_draws_it():
    gen = np.random.default_rng(0)
    shares, ratios = [], []
    for _ in range(2000):
        top, left, h, w = tp.image.random_resized_crop_window(400, 400, rng=gen)
        assert top >= 0 and top + h <= 400 and left >= 0 and left + w <= 400
        shares.append(h * w / (400 * 400))
        ratios.append(w / h)
    # uniform in [0.08, 1] before rejection (a mean of 0.54); wide windows that do not fit are drawn again
    assert 0.08 <= min(shares) < 0.1 and 0.9 < max(shares) <= 1.0 and 0.42 < np.mean(shares) < 0.52
    assert min(ratios) > 3 / 4 - 0.05 and max(ratios) < 4 / 3 + 0.05
    assert abs(np.mean(np.log(ratios))) < 0.02  # log-uniform, symmetric around 1
    # no window fits ten times: the central crop at the nearest allowed ratio
    assert tp.image.random_resized_crop_window(100, 400, scale=(0.99, 1.0), rng=gen) == (
        0,
        133,
        100,
        133,
    )
    with pytest.raises(ValueError, match="scale must be"):
        tp.image.random_resized_crop_window(10, 10, scale=(0.5, 0.1))


def test_the_dct_scale_keeps_the_window_at_least_the_output():
    assert dct_scale((224, 224), (224, 224)) == 1
    assert dct_scale((100, 100), (224, 224)) == 1
    assert dct_scale((500, 460), (224, 224)) == 2
    assert dct_scale((1000, 900), (224, 224)) == 4
    assert dct_scale((4000, 3000), (224, 224)) == 8


def test_decode_and_random_resized_crop_is_the_crop_of_the_decoded_image():
    big = Image.fromarray(photo(640, 800, seed=3))
    data = encode(big, quality=92)
    full = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB")))
    for seed in range(20):
        window = tp.image.random_resized_crop_window(640, 800, rng=np.random.default_rng(seed))
        fused = tp.image.decode_and_random_resized_crop(
            data, (64, 48), rng=np.random.default_rng(seed)
        )
        top, left, h, w = window
        plain = tp.image.resize(full[top : top + h, left : left + w], (64, 48))
        assert fused.shape == (64, 48, 3)
        diff = (fused.float() - plain.float()).abs()
        if dct_scale((h, w), (64, 48)) == 1:
            assert diff.max() == 0
        else:  # decoded smaller: the same window, averaged by the DCT's scaling first (the image has +-8 noise)
            assert diff.mean() < 6, (window, diff.mean())
    assert tp.image.decode_and_random_resized_crop(
        encode(big, "PNG"), 32, rng=np.random.default_rng(0)
    ).shape == (32, 32, 3)


def _augment(data: bytes) -> torch.Tensor:
    crop = tp.image.decode_and_random_resized_crop(data, 32)
    return tp.image.to_tensor(tp.image.random_flip_left_right(crop), MEAN, STD)


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    return [encode(Image.fromarray(photo(90, 120, seed=i)), quality=90) for i in range(24)]


def test_random_ops_give_the_same_output_on_every_executor(jpegs):
    def run(executor, parallel):
        ds = tp.from_iterable(jpegs).map(_augment, num_parallel_calls=parallel, executor=executor)
        return torch.stack(list(ds.with_options(tp.Options(seed=5))))

    inline = run("thread", None)
    assert torch.equal(inline, run("thread", 3))
    assert torch.equal(inline, run("process", 2))
    assert not torch.equal(inline[0], inline[1])  # each element draws its own window


class JpegFolder(torch.utils.data.Dataset):
    """A torchvision-style dataset written with tp.image."""

    def __init__(self, jpegs: list[bytes]) -> None:
        self.jpegs = jpegs

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return _augment(self.jpegs[i]), i


def test_in_a_dataloader_the_draws_repeat_wherever_batches_are_made(jpegs):
    def run(num_workers):
        loader = tp.DataLoader(
            JpegFolder(jpegs),
            batch_size=4,
            shuffle=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(3),
        )
        return [(x, y) for x, y in loader]

    auto, two = run("auto"), run(2)
    assert len(auto) == 6
    for (xa, ya), (xb, yb) in zip(auto, two):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)
    assert sorted(torch.cat([y for _, y in auto]).tolist()) == list(range(24))
    assert all(math.isfinite(float(x.sum())) for x, _ in auto)


def _crop_flip_chw(data: bytes) -> torch.Tensor:
    """The bench's fixed crop: decode, a random 224 crop, a random flip, CHW uint8."""
    crop = tp.image.random_crop(tp.image.decode_jpeg(data, fast_dct=True), 224)
    return tp.image.to_tensor(tp.image.random_flip_left_right(crop), dtype=torch.uint8)


@pytest.fixture(scope="module")
def large_jpegs() -> list[bytes]:
    # eight 224 crops of uint8 make a batch of 1.2 MB: large enough to be stacked into reused memory
    return [encode(Image.fromarray(photo(240, 300, seed=i)), quality=90) for i in range(16)]


@pytest.mark.parametrize("between", [None, "shuffle", "cache", "stash"])
@pytest.mark.parametrize("parallel", [None, 2])
def test_to_tensor_writes_its_rows_of_a_batch_in_place_with_the_pixels_it_gives_alone(
    large_jpegs, between, parallel
):
    made: dict[bytes, torch.Tensor] = {}  # kept: their values must not change

    def item(data: bytes) -> torch.Tensor:
        made[data] = _crop_flip_chw(data)
        return 255 - made[data] if between == "stash" else made[data]

    def run(collate_fn):
        made.clear()
        ds = tp.from_iterable(large_jpegs).map(item, num_parallel_calls=parallel, executor="thread")
        if between == "shuffle":
            ds = ds.shuffle(5)
        elif between == "cache":
            ds = ds.cache()
        ds = ds.batch(8, collate_fn=collate_fn).with_options(tp.Options(seed=3))
        batches = []
        for _ in range(1 + (between == "cache")):
            for batch in ds:
                batches.append(batch.clone())
                batch.zero_()  # as a consumer normalizing in place
        return batches

    stacked = run(torch.stack)  # a collate_fn: nothing is written in place
    alone = {data: t.clone() for data, t in made.items()}
    in_place = run(None)
    assert len(in_place) == len(stacked) and made.keys() == alone.keys()
    for mine, theirs in zip(in_place, stacked):
        assert torch.equal(mine, theirs)
    if between is not None:  # else the kept tensors are the batches' rows, zeroed by the consumer
        for data, t in made.items():
            assert torch.equal(t, alone[data])


@pytest.mark.parametrize("parallel", [None, 2])
def test_to_tensor_in_a_map_batched_after_it_writes_the_batch_itself(large_jpegs, parallel):
    made: list[torch.Tensor] = []

    def item(data: bytes) -> torch.Tensor:
        made.append(_crop_flip_chw(data))
        return made[-1]

    ds = tp.from_iterable(large_jpegs).map(item, num_parallel_calls=parallel, executor="thread")
    batch = next(iter(ds.batch(8)))
    rows = {batch[j].data_ptr() for j in range(8)}
    # the first image decides the rows, and is copied to its own; the others wrote theirs
    assert sum(t.data_ptr() in rows for t in list(made)) == 7
