"""tp.from_ray: a Ray Dataset's rows as iter_rows() gives them, a cursor checkpoint that resumes on
streaming and materialized datasets, and a Ray Train worker's shard fed through a pipeline."""

import numpy as np
import pytest

import torchpipe as tp
from torchpipe.testing import assert_checkpoint_roundtrip, assert_same_elements

# One suite worker runs every Ray test (one cluster at a time); a Ray worker imports torch for
# each task, so on two loaded cores a test may take well over a minute: the cap is a hang guard.
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(150)]


def _columns(row):
    return {"id": row["id"], "x": np.full(3, row["id"], np.float32), "s": f"row {row['id']}"}


@pytest.fixture(scope="module")
def rows(ray_cluster):
    """A dataset of 30 rows in 4 blocks: a scalar, a tensor and a string column."""
    return ray_cluster.data.range(30, override_num_blocks=4).map(_columns)


def test_from_ray_refuses_what_is_not_a_ray_dataset(ray_cluster):
    with pytest.raises(TypeError, match="ray.data.Dataset"):
        tp.from_ray([1, 2, 3])


def test_rows_are_what_iter_rows_gives(rows):
    got = list(tp.from_ray(rows))
    assert_same_elements(got, list(rows.iter_rows()))
    assert type(got[3]["id"]) is int and got[3]["x"].shape == (3,) and got[3]["s"] == "row 3"


def test_the_checkpoint_is_a_cursor_that_resumes_streaming_and_materialized_datasets(rows):
    assert_checkpoint_roundtrip(tp.from_ray(rows).batch(4), positions=[0, 3, 7, 8])
    materialized = rows.materialize()
    assert len(tp.from_ray(materialized)) == 30  # its length is known
    assert_checkpoint_roundtrip(tp.from_ray(materialized), positions=[0, 9, 29])


def test_a_ray_data_source_feeds_stages_on_ray_actors(rows):
    def make(executor):
        return tp.from_ray(rows).map(lambda r: r["x"] * r["id"], 2, executor=executor).batch(5)

    # Ray Data's own tasks need a CPU of the cluster's two: the actors take half a CPU each.
    assert_same_elements(list(make(tp.RayExecutor(num_cpus=0.5))), list(make("process")))


def _train_worker(shard, rank):
    """What a Ray Train worker runs: its dataset shard through a pipeline whose stage runs on the
    cluster's actors, on a rank of 2 (as under TorchTrainer, where torch.distributed is set up)."""
    distribute = tp.DistributeOptions(rank=rank, world_size=2)
    ds = tp.from_ray(shard).map(lambda r: r["id"] * 2, 1, executor=tp.RayExecutor(num_cpus=0.25))
    return [int(x) for x in ds.with_options(tp.Options(distribute=distribute))]


def test_a_train_workers_shard_is_not_split_again(ray_cluster, rows):
    explained = (
        tp.from_ray(rows.iterator())
        .with_options(tp.Options(distribute=tp.DistributeOptions(rank=0, world_size=2)))
        .explain()
    )
    assert "Ray Train worker's dataset shard: not split again" in explained
    shards = ray_cluster.data.range(40, override_num_blocks=4).streaming_split(2, equal=True)
    worker = ray_cluster.remote(num_cpus=0)(_train_worker)
    first, second = ray_cluster.get(
        [worker.remote(shard, rank) for rank, shard in enumerate(shards)], timeout=120
    )
    assert len(first) == len(second) == 20 and sorted(first + second) == list(range(0, 80, 2))
