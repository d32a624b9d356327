"""ShardWriters: elements written to their shards by writer threads, in order; errors raised."""

import os

import pytest
import torch

from torchpipe.storage.element_spec import element_spec, merge_specs
from torchpipe.storage.save_writers import ShardWriters
from torchpipe.storage.saved_file import (
    FORMAT,
    FORMAT_VERSION,
    SavedRecords,
    ShardFile,
    shard_name,
    write_manifest,
)

ORIGIN = (5, 0, ())
PIPELINE = ["range(start=0, stop=5, step=1, len=5)"]
GENERATION = "0badcafe"


def _writers(directory, threads=2, compression=None, **kwargs):
    return ShardWriters(
        str(directory), GENERATION, ORIGIN, PIPELINE, compression, threads, **kwargs
    )


def _read_back(directory, entries, compression=None):
    """The elements of the shards ``entries`` name, through a manifest, by element index."""
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "generation": GENERATION,
        "count": sum(entry["records"] for entry in entries),
        "compression": compression,
        "origin": [ORIGIN[0], ORIGIN[1], []],
        "shards": [{k: v for k, v in entry.items() if k != "shard"} for entry in entries],
        "pipeline": PIPELINE,
        "element_spec": {"kind": "any"},
    }
    write_manifest(str(directory), manifest)
    records = SavedRecords(directory)
    return [records[i] for i in range(len(records))]


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_every_element_lands_in_its_shard_once(tmp_path, compression):
    writers = _writers(tmp_path, threads=2, compression=compression)
    for index in range(30):
        writers.add(index % 3, index, {"x": index})
    entries = writers.finish()
    assert [entry["shard"] for entry in entries] == [0, 1, 2]
    assert [entry["records"] for entry in entries] == [10, 10, 10]
    assert _read_back(tmp_path, entries, compression) == [{"x": i} for i in range(30)]


def test_positions_and_spec_tell_what_was_written_after_a_drain(tmp_path):
    writers = _writers(tmp_path, threads=2)
    writers.add(0, 0, torch.zeros(2))
    writers.add(1, 1, torch.zeros(3))
    writers.add(1, 2, torch.zeros(3))
    writers.drain(sync=True)
    positions = writers.positions()
    assert sorted(positions) == [0, 1] and positions[0][1] == 1 and positions[1][1] == 2
    assert positions[1][0] > positions[0][0] > 0
    assert writers.spec == merge_specs(element_spec(torch.zeros(2)), element_spec(torch.zeros(3)))
    writers.close()


def test_an_element_that_cannot_be_written_is_raised_naming_it_and_its_shard(tmp_path):
    writers = _writers(tmp_path, threads=1, stage="save(/data)")
    writers.add(0, 0, 1)
    writers.add(1, 7, lambda: None)  # cannot be pickled
    with pytest.raises(Exception) as raised:
        writers.drain(sync=False)
    notes = getattr(raised.value, "__notes__", [])
    assert "raised in torchpipe save(/data) while writing element 7 to shard 1" in notes
    with pytest.raises(type(raised.value)):  # the save has failed: every later add says so
        writers.add(0, 8, 2)
    writers.close()


def test_closing_leaves_unfinished_shards_partial_for_a_resume(tmp_path):
    writers = _writers(tmp_path, threads=2)
    writers.add(0, 0, "a")
    writers.add(1, 1, "b")
    writers.drain(sync=False)
    bytes_0, count_0 = writers.positions()[0]
    writers.close()
    names = sorted(os.listdir(tmp_path))
    assert names and all(name.endswith(".partial") for name in names)
    resumed = ShardFile.resume(str(tmp_path), shard_name(GENERATION, 0), bytes_0, count_0, PIPELINE)
    writers = _writers(tmp_path, threads=2, resumed={0: resumed}, spec=element_spec("a"))
    writers.add(0, 2, "c")
    writers.add(1, 1, "b")  # shard 1 is written afresh
    entries = writers.finish()
    assert [entry["records"] for entry in entries] == [2, 1]
    assert _read_back(tmp_path, entries) == ["a", "b", "c"]
