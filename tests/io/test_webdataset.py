"""WebDataset tar shards: grouping as the webdataset package does (checked against it, both ways),
brace-expanded shard lists, per-shard checkpoints, shard shuffling, rank/worker splits,
decoders and damaged shards."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds

import torchpipe as tp
from tests.disk_limits import no_room, payload  # noqa: F401 - no_room is a fixture
from torchpipe.errors import CheckpointError
from torchpipe.testing import assert_checkpoint_roundtrip


def samples(shard: int, count: int = 4) -> list[dict]:
    return [
        {
            "__key__": f"s{shard}/{i:04d}",
            "cls": str(i % 3).encode(),
            "txt": f"shard {shard} #{i}".encode(),
            "bin": bytes([shard, i]) * (50 * i),
        }
        for i in range(count)
    ]


@pytest.fixture
def shards(tmp_path):
    for k in range(4):
        with tp.io.TarWriter(tmp_path / f"shard-{k:06d}.tar") as writer:
            for sample in samples(k, 3 + k):
                writer.write(sample)
    return str(tmp_path / "shard-{000000..000003}.tar")


def without_local_path(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if k != "__local_path__"}


def test_webdataset_reads_tarwriter_shards_unchanged(shards):
    theirs = [without_local_path(s) for s in wds.WebDataset(shards, shardshuffle=False)]
    ours = list(tp.from_webdataset(shards))
    assert ours == theirs and len(ours) == 3 + 4 + 5 + 6
    written = [s for k in range(4) for s in samples(k, 3 + k)]
    assert [{k: v for k, v in s.items() if k != "__url__"} for s in ours] == written
    assert ours[0]["__url__"].endswith("shard-000000.tar")


def test_shards_webdatasets_writer_makes_read_the_same(tmp_path):
    path = str(tmp_path / "theirs.tar")
    with wds.TarWriter(path) as writer:
        for i in range(5):
            writer.write(
                {
                    "__key__": f"k{i}",
                    "cls": i,
                    "json": {"i": i},
                    "seg.png": np.full((4, 5, 3), i, np.uint8),
                }
            )
    theirs = [without_local_path(s) for s in wds.WebDataset(path, shardshuffle=False)]
    assert list(tp.from_webdataset(path)) == theirs
    decoded = list(tp.from_webdataset(path, decode=True))
    assert [d["cls"] for d in decoded] == list(range(5)) and decoded[2]["json"] == {"i": 2}
    assert decoded[3]["seg.png"].shape == (3, 4, 5) and decoded[3]["seg.png"].dtype == torch.uint8


def test_grouping_skips_and_splits_names_as_webdataset_does(tmp_path):
    path = str(tmp_path / "odd.tar")
    names = [
        "a/b.c/x1.JPG",
        "a/b.c/x1.seg.PNG",
        "noext",
        "__meta__",
        "x2.txt",
        "x2.cls",
        ".hidden.txt",
        "x1.txt",
    ]
    with tarfile.open(path, "w") as tar:
        for name in names:
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        directory = tarfile.TarInfo("somedir")
        directory.type = tarfile.DIRTYPE
        tar.addfile(directory)
    theirs = [without_local_path(s) for s in wds.WebDataset(path, shardshuffle=False)]
    ours = list(tp.from_webdataset(path))
    assert ours == theirs
    assert [s["__key__"] for s in ours] == ["a/b.c/x1", "x2", "x1"] and set(ours[0]) >= {
        "jpg",
        "seg.png",
    }


def test_checkpoints_at_every_sample(shards, tmp_path):
    assert_checkpoint_roundtrip(tp.from_webdataset(shards))
    assert_checkpoint_roundtrip(
        tp.from_webdataset(shards, num_parallel_reads=2), positions=range(0, 18, 3)
    )
    assert_checkpoint_roundtrip(
        tp.from_webdataset(shards, shardshuffle=True, seed=4), positions=range(0, 18, 4)
    )
    with tp.io.TarWriter(tmp_path / "z.tar.gz") as writer:
        for sample in samples(9, 5):
            writer.write(sample)
    gz = str(tmp_path / "z.tar.gz")
    assert [s["__key__"] for s in tp.from_webdataset(gz)] == [s["__key__"] for s in samples(9, 5)]
    assert_checkpoint_roundtrip(tp.from_webdataset(gz))


def test_checkpoint_is_the_next_samples_offset_and_resume_seeks(tmp_path):
    path = str(tmp_path / "one.tar")
    with tp.io.TarWriter(path) as writer:
        for sample in samples(0, 4):
            writer.write(sample)
    it = iter(tp.from_webdataset(path))
    first = [next(it), next(it)]
    state = it.state_dict()
    it.close()
    inner = state["pipeline"]["slots"][0][
        "inner"
    ]  # flat_map over the shard list: the shard's reader
    offset = inner["offset"]
    assert inner["file"] == path and offset > 0 and offset % 512 == 0
    with open(path, "r+b") as f:  # wipe the samples before the checkpoint: a seek never reads them
        f.write(b"\0" * offset)
    resumed = iter(tp.from_webdataset(path))
    resumed.load_state_dict(state)
    assert [s["__key__"] for s in resumed] == ["s0/0002", "s0/0003"] and first[1][
        "__key__"
    ] == "s0/0001"


def test_shard_shuffle_follows_the_pipeline_seed(shards):
    def order(ds):
        keys = [s["__key__"] for s in ds]
        return [
            k.split("/")[0]
            for i, k in enumerate(keys)
            if i == 0 or keys[i - 1].split("/")[0] != k.split("/")[0]
        ]

    ds = tp.from_webdataset(shards, shardshuffle=True).with_options(tp.Options(seed=7))
    first, second = order(ds), order(ds)
    assert sorted(first) == ["s0", "s1", "s2", "s3"] and first != second  # reshuffled each epoch
    again = tp.from_webdataset(shards, shardshuffle=True).with_options(tp.Options(seed=7))
    assert order(again) == first
    assert order(tp.from_webdataset(shards)) == ["s0", "s1", "s2", "s3"]


def test_dataloader_workers_split_the_shards(shards):
    loader = torch.utils.data.DataLoader(tp.from_webdataset(shards), batch_size=None, num_workers=2)
    keys = [s["__key__"] for s in loader]
    assert sorted(keys) == sorted(s["__key__"] for s in tp.from_webdataset(shards)) and len(
        set(keys)
    ) == len(keys)


def test_ranks_split_the_shards_and_need_a_shared_seed_to_shuffle(shards):
    # ranks simulated in this process (tests/distributed/test_files.py has more; on real ranks,
    # tests/distributed/test_gloo_ranks.py, a shuffle without a seed shares rank 0's)
    def on_rank(ds, rank, world_size, policy="auto"):
        distribute = tp.DistributeOptions(
            policy=policy, rank=rank, world_size=world_size, uneven="allow"
        )
        return ds.with_options(tp.Options(distribute=distribute))

    mine = {s["__key__"].split("/")[0] for s in on_rank(tp.from_webdataset(shards), 1, 2)}
    assert mine == {"s1", "s3"}
    with pytest.raises(
        RuntimeError, match="every rank must draw the same seed.*tp.Options\\(seed=...\\)"
    ):
        # these ranks cannot share rank 0's
        iter(on_rank(tp.from_webdataset(shards, shardshuffle=True), 0, 2))
    ranks = []
    for rank in (0, 1):  # the same seed on every rank: disjoint shares that cover every shard
        ranks.append(
            {
                s["__key__"]
                for s in on_rank(tp.from_webdataset(shards, shardshuffle=True, seed=1), rank, 2)
            }
        )
    assert not ranks[0] & ranks[1] and len(ranks[0] | ranks[1]) == 18
    with pytest.raises(ValueError, match="4 files for 8 ranks x 1 workers"):
        iter(on_rank(tp.from_webdataset(shards), 0, 8, policy="file"))
    it = iter(on_rank(tp.from_webdataset(shards), 0, 2))
    next(it)
    state = it.state_dict()
    with pytest.raises(CheckpointError, match="rank 0 of 2's and this is rank 1 of 2"):
        iter(on_rank(tp.from_webdataset(shards), 1, 2)).load_state_dict(state)
    assert len(list(on_rank(tp.from_webdataset(shards, split_by_rank=False), 1, 2))) == 18


def test_damaged_shards_name_the_url_and_offset(shards, tmp_path):
    paths = tp.io.expand_braces(shards)
    data = open(paths[1], "rb").read()
    open(paths[1], "wb").write(data[: len(data) // 2 + 100])
    with pytest.raises(tp.io.DataLossError, match=f"{paths[1]}: damaged tar shard at byte") as info:
        list(tp.from_webdataset(shards))
    assert info.value.path == paths[1] and info.value.offset > 0
    it = iter(tp.from_webdataset(shards).ignore_errors())
    keys = [s["__key__"] for s in it]
    assert keys[:3] == ["s0/0000", "s0/0001", "s0/0002"] and keys[-6:] == [
        f"s3/{i:04d}" for i in range(6)
    ]
    assert {s["stage"]: s for s in it.stats()}["ignore_errors"]["errors_ignored"] == 1


def test_decoders_by_extension_and_overrides(tmp_path):
    path = str(tmp_path / "d.tar")
    image = torch.arange(2 * 3 * 3, dtype=torch.uint8).reshape(3, 2, 3) * 10
    tensor = torch.tensor([1.5, -2.0])
    with tp.io.TarWriter(path) as writer:
        writer.write(
            {
                "__key__": "a",
                "png": image,
                "cls": 7,
                "txt": "h\u00e9",
                "json": [1, {"x": None}],
                "npy": np.arange(4, dtype=np.int16),
                "pth": {"w": tensor},
                "raw": b"\x00\x01",
                "input.png": image,
            }
        )
    (sample,) = tp.from_webdataset(path, decode=True)
    assert torch.equal(sample["png"], image) and torch.equal(sample["input.png"], image)
    assert sample["cls"] == 7 and sample["txt"] == "h\u00e9" and sample["json"] == [1, {"x": None}]
    assert sample["npy"].dtype == torch.int16 and sample["npy"].tolist() == [0, 1, 2, 3]
    assert torch.equal(sample["pth"]["w"], tensor) and sample["raw"] == b"\x00\x01"
    (raw,) = tp.from_webdataset(path)
    custom = tp.io.SampleDecoder({"png": None, "txt": lambda b: b.decode().upper()})(raw)
    assert custom["png"] == raw["png"] and custom["txt"] == "H\u00c9" and custom["cls"] == 7
    broken = dict(raw, cls=b"seven")
    with pytest.raises(ValueError) as info:
        tp.io.SampleDecoder()(broken)
    assert "decoding field 'cls' of sample 'a'" in str(info.value.__notes__)
    assert tp.io.DEFAULT_DECODERS["jpg"] is tp.io.DEFAULT_DECODERS["png"]


def test_tarwriter_rejects_bad_samples(tmp_path):
    writer = tp.io.TarWriter(tmp_path / "w.tar")
    with pytest.raises(ValueError, match="__key__"):
        writer.write({"txt": b"x"})
    with pytest.raises(ValueError, match="without a dot"):
        writer.write({"__key__": "a.b", "txt": b"x"})
    with pytest.raises(TypeError, match="no encoder for a set"):
        writer.write({"__key__": "a", "bin": {1}})
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.write({"__key__": "a", "txt": b"x"})
    assert list(tp.from_webdataset(str(tmp_path / "w.tar"))) == []


def test_bad_arguments():
    with pytest.raises(TypeError):
        tp.from_webdataset(5)
    with pytest.raises(TypeError, match="decode"):
        tp.from_webdataset("x.tar", decode="yes")
    with pytest.raises(ValueError):
        tp.from_webdataset("x.tar", num_parallel_reads=0)
    with pytest.raises(TypeError, match="known length"):
        tp.from_webdataset(tp.from_tensor_slices(["x.tar"]))
    with pytest.raises(TypeError):
        tp.io.SampleDecoder({"png": 3})
    assert json.loads(json.dumps({"ok": True}))


def _write_shard(path, count):
    with tp.io.TarWriter(path) as writer:
        for i in range(count):
            writer.write({"__key__": f"k{i}", "bin": payload(i)})


# nothing written when dropped
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_tarwriter_on_a_full_disk_fails_naming_the_file_and_leaves_the_file_there_before_unchanged(
    no_room,
):
    path = os.path.join(no_room.directory, "a.tar")
    _write_shard(path, 1)
    no_room.check(no_room.run(_write_shard, path, 8), f"TarWriter({path})")
    assert no_room.files() == ["a.tar"] and [s["bin"] for s in tp.from_webdataset(path)] == [
        payload(0)
    ]
    no_room.grow()
    _write_shard(path, 8)
    assert [s["bin"] for s in tp.from_webdataset(path)] == [payload(i) for i in range(8)]
