"""tp.image.train_transform: the training transform in one op, against its unfused ops and Pillow."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

import torchpipe as tp
from tests.image.conftest import encode, photo

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZE = 40


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    """Photo-like JPEGs under twice the output a side: every window is decoded at full size."""
    return [encode(Image.fromarray(photo(60, 76, seed)), quality=90) for seed in range(6)]


def unfused(data, rng, **kwargs):
    image = tp.image.decode_and_random_resized_crop(data, SIZE, rng=rng)
    return tp.image.to_tensor(tp.image.random_flip_left_right(image, rng=rng), MEAN, STD, **kwargs)


@pytest.mark.parametrize("seed", range(6))
def test_it_gives_exactly_what_the_unfused_ops_give_with_the_same_generator(jpegs, seed):
    data = jpegs[seed]
    got = tp.image.train_transform(data, SIZE, MEAN, STD, rng=np.random.default_rng(seed))
    assert got.shape == (3, SIZE, SIZE) and got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, unfused(data, np.random.default_rng(seed)))


def test_a_png_goes_through_pillow_with_the_same_draws():
    data = encode(Image.fromarray(photo(50, 70)), "PNG")
    got = tp.image.train_transform(data, SIZE, MEAN, STD, rng=np.random.default_rng(1))
    assert torch.equal(got, unfused(data, np.random.default_rng(1)))


def pillow_reference(data: bytes, seed: int, flip: float) -> torch.Tensor:
    """Pillow's decode of the same window (drawn from the same generator), cropped and resized
    with its antialiased BILINEAR as torchvision's RandomResizedCrop does on a Pillow image,
    mirrored as drawn, as torchvision's ToTensor and Normalize make it."""
    rng = np.random.default_rng(seed)
    with Image.open(io.BytesIO(data)) as im:
        rgb = im.convert("RGB")
    top, left, h, w = tp.image.random_resized_crop_window(rgb.height, rgb.width, rng=rng)
    # torchvision's order
    crop = rgb.crop((left, top, left + w, top + h)).resize((SIZE, SIZE), Image.BILINEAR)
    if rng.random() < flip:
        crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
    x = torch.from_numpy(np.asarray(crop).copy()).permute(2, 0, 1).float() / 255
    return (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


@pytest.mark.parametrize("flip", [0.0, 1.0])
@pytest.mark.parametrize("seed", range(6))
def test_pixels_match_pillows_decode_crop_and_resize_of_the_same_window(jpegs, seed, flip):
    got = tp.image.train_transform(
        jpegs[seed], SIZE, MEAN, STD, flip=flip, rng=np.random.default_rng(seed)
    )
    want = pillow_reference(jpegs[seed], seed, flip)
    # docs/image.md: the resize is within 1 of Pillow's BILINEAR in uint8 levels, here normalized
    tolerance = 1 / (255 * min(STD)) + 1e-5
    assert (got - want).abs().max().item() <= tolerance
    assert (got - want).abs().mean().item() < 0.25 * tolerance  # most pixels are equal


def test_uint8_keeps_the_values_and_out_is_written():
    data = encode(Image.fromarray(photo(60, 76)), quality=90)
    out = torch.empty(3, SIZE, SIZE, dtype=torch.uint8)
    got = tp.image.train_transform(
        data, SIZE, dtype=torch.uint8, rng=np.random.default_rng(2), out=out
    )
    assert got is out
    g = np.random.default_rng(2)
    image = tp.image.random_flip_left_right(
        tp.image.decode_and_random_resized_crop(data, SIZE, rng=g), rng=g
    )
    assert torch.equal(out, image.permute(2, 0, 1))


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"flip": 1.5}, ValueError),
        ({"dtype": torch.uint8, "mean": MEAN, "std": STD}, ValueError),
        ({"mean": MEAN}, ValueError),
        ({"out": torch.empty(3, SIZE, SIZE + 1)}, ValueError),
        ({"out": torch.empty(3, SIZE, SIZE, dtype=torch.float64)}, ValueError),
        ({"scale": (0.5, 0.1)}, ValueError),
        ({"channels": 2}, ValueError),
        ({"rng": 3}, TypeError),
    ],
)
def test_bad_arguments_raise(jpegs, kwargs, error):
    with pytest.raises(error):
        tp.image.train_transform(jpegs[0], SIZE, **kwargs)


def test_a_damaged_image_raises_decode_error(jpegs):
    with pytest.raises(tp.image.DecodeError):
        tp.image.train_transform(jpegs[0][:200], SIZE, MEAN, STD)


def transform(data, label, size=SIZE):
    return tp.image.train_transform(data, size, MEAN, STD), label


def steps(data, label, size=SIZE):
    image = tp.image.random_flip_left_right(tp.image.decode_and_random_resized_crop(data, size))
    return tp.image.to_tensor(image, MEAN, STD), label


def large_transform(data, label):  # rows large enough to be placed in the batch's memory
    return transform(data, label, 224)


def large_steps(data, label):
    return steps(data, label, 224)


def batches(fn, jpegs, **map_args):
    data = [jpegs[i % len(jpegs)] for i in range(10)]
    ds = tp.from_tensor_slices((data, list(range(10)))).map(fn, **map_args).batch(4)
    return list(ds.with_options(tp.Options(seed=5)))


@pytest.mark.parametrize(
    "map_args",
    [
        {},
        {"num_parallel_calls": 2, "executor": "thread"},
        {"num_parallel_calls": 2, "executor": "process"},
    ],
)
def test_in_a_pipeline_batches_equal_the_unfused_ops_on_any_executor(jpegs, map_args):
    got, want = batches(transform, jpegs, **map_args), batches(steps, jpegs)
    assert [b[0].shape[0] for b in got] == [4, 4, 2]
    for (x, labels), (y, want_labels) in zip(got, want):
        assert torch.equal(x, y) and torch.equal(labels, want_labels)


def test_a_batch_made_on_threads_holds_the_rows_written_in_place(jpegs, monkeypatch):
    from torchpipe.runtime import recycle

    lent = []
    row_for = recycle.BatchRows.row_for

    def spy(self, shape, dtype):
        row = row_for(self, shape, dtype)
        lent.append(row)
        return row

    monkeypatch.setattr(recycle.BatchRows, "row_for", spy)
    got = batches(large_transform, jpegs, num_parallel_calls=2, executor="thread")
    assert sum(row is not None for row in lent) >= 3  # all but each batch's first element
    for row in (r for r in lent if r is not None):
        assert any(
            b[0].untyped_storage().data_ptr() == row.untyped_storage().data_ptr() for b in got
        )
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(got, batches(large_steps, jpegs)))


@pytest.mark.parametrize("between", ["shuffle", "cache"])
def test_rows_are_not_lent_through_an_op_that_keeps_elements(jpegs, between):
    # a row lent to an image kept in a shuffle buffer was overwritten by the element placed there
    def run(collate_fn):
        data = [jpegs[i % len(jpegs)] for i in range(16)]
        ds = tp.from_tensor_slices((data, list(range(16)))).map(large_transform)
        ds = ds.shuffle(5) if between == "shuffle" else ds.cache()
        ds = ds.batch(8, collate_fn=collate_fn).with_options(tp.Options(seed=5))
        out = []
        for _ in range(2):
            for images, labels in ds:
                out.append((images.clone(), labels.clone()))
                images.zero_()  # as a consumer normalizing in place
        return out

    def stack(elements):
        return torch.stack([e[0] for e in elements]), torch.tensor([e[1] for e in elements])

    for (x, labels), (y, want_labels) in zip(run(None), run(stack)):
        assert torch.equal(labels, want_labels) and torch.equal(x, y)
