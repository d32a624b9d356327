"""tp.DataLoader under Hugging Face Accelerate and transformers' Trainer (torchpipe/integrations/accelerate.py).

The real libraries, a tiny model built from a config (no downloads), on one process and on two
gloo ranks started here as ``accelerate launch`` starts them (torch.distributed's variables).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch

import torchpipe as tp
from tests.cluster import free_port
from torchpipe.loader import rebuild

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator, DataLoaderConfiguration  # noqa: E402 - after the skip
from accelerate.utils import set_seed  # noqa: E402

from torchpipe.integrations.accelerate import AcceleratedDataLoader, TrainerMixin, use_torchpipe  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Points(torch.utils.data.Dataset):
    """Element ``i``: ``(i, x, y)`` with ``x`` and ``y`` fixed functions of ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.tensor([i % 7, i % 5, i % 3, 1.0]) / 4
        return i, x, x.sum() * 0.5 - 0.25


class Stream(torch.utils.data.IterableDataset):
    """``Points(n)``'s elements, in order, as an IterableDataset."""

    def __init__(self, n: int) -> None:
        self.points = Points(n)

    def __iter__(self):
        return (self.points[i] for i in range(len(self.points)))


def stream_batches(torchpipe, n, load=False, save_at=None, dispatch=None):
    """The indices of each batch of ``Stream(n)`` (3 a batch) through a prepared loader: torchpipe's,
    or Accelerate's own without dispatching; ``save_state`` after batch ``save_at`` or ``load_state``.
    ``dispatch``: Accelerate's setting (torchpipe's loader: None, its default, or False)."""
    dispatch = dispatch if torchpipe else False
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch)
    )
    loader_class = tp.DataLoader if torchpipe else torch.utils.data.DataLoader
    loader = accelerator.prepare(
        (use_torchpipe(accelerator) and loader_class)(Stream(n), batch_size=3)
    )
    if load:
        accelerator.load_state(os.environ["TP_TEST_STATE"])
    seen = []
    for i, _, _ in loader:
        seen.append(i.tolist())
        if len(seen) == save_at:
            accelerator.save_state(os.environ["TP_TEST_STATE"])
            accelerator.wait_for_everyone()  # rank 0 has written it (the test loads it next)
    return seen, loader


class Tokens(torch.utils.data.Dataset):
    """Sequence classification examples for a tiny BERT: ``labels`` is the parity of the first token."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        ids = torch.tensor([(i * 7 + k * 3) % 50 for k in range(8)])
        return {"input_ids": ids, "labels": torch.tensor(int(ids[0]) % 2)}


def train(
    loader_class, num_workers=0, *, patched=True, epochs=2, save_at=None, load_from=None, n=22
):
    """Linear regression on ``Points(n)`` for ``epochs`` epochs: ``(epoch, indices, loss)`` per step;
    ``save_state`` after step ``save_at``, or ``load_state`` from ``load_from`` before the first."""
    set_seed(0)
    accelerator = Accelerator(cpu=True)
    if patched:
        use_torchpipe(accelerator)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = {"num_workers": num_workers} if num_workers != 0 else {}
    loader = loader_class(Points(n), batch_size=4, shuffle=True, **kwargs)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    first = 0
    if load_from is not None:
        accelerator.load_state(load_from)
        first = loader.iteration  # the epoch the state was taken in
    steps = []
    for epoch in range(first, epochs):
        for i, x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps.append((epoch, i.tolist(), loss.item()))
            if len(steps) == save_at:
                accelerator.save_state(os.environ["TP_TEST_STATE"])
            accelerator.wait_for_everyone()  # rank 0 has written it (the test loads it next)
    return steps, loader


def plain_loader_steps(num_workers, epochs=2, n=22):
    """``train``'s steps with the tp.DataLoader iterated as it is (no Accelerate)."""
    set_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = tp.DataLoader(Points(n), batch_size=4, shuffle=True, num_workers=num_workers)
    steps = []
    for epoch in range(epochs):
        for i, x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps.append((epoch, i.tolist(), loss.item()))
    return steps


@contextlib.contextmanager
def no_rebuild_warning():
    """A block in which torchpipe's rebuild warning is an error (other libraries' warnings are not)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*rebuilding a torchpipe")
        yield


@pytest.fixture(autouse=True)
def _state_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TP_TEST_STATE", str(tmp_path / "state"))
    monkeypatch.setattr(rebuild, "warned", False)


@pytest.mark.parametrize("num_workers", [0, "auto"])
def test_prepare_keeps_torchpipe_with_torch_s_batches_and_losses(num_workers):
    with no_rebuild_warning():  # nothing is rebuilt behind the user's back
        steps, loader = train(tp.DataLoader, num_workers)
    assert isinstance(loader, AcceleratedDataLoader) and isinstance(loader, tp.DataLoader)
    if num_workers == "auto":
        assert "measured" in loader.stats()[0]  # what a num_workers="auto" loader reports
    expected, torch_loader = train(torch.utils.data.DataLoader, patched=False)
    assert (
        type(torch_loader.base_dataloader) is torch.utils.data.DataLoader
    )  # Accelerate's own rebuild
    if num_workers == "auto":
        # torch's for the first epoch, and every step as an unprepared tp.DataLoader("auto") makes it
        assert steps[:6] == expected[:6]
        expected = plain_loader_steps(num_workers)
    assert steps == expected
    assert sorted(x for _, batch, _ in steps[:6] for x in batch) == list(range(22))


@pytest.mark.parametrize("num_workers, save_at", [(0, 8), (2, 8), ("auto", 8), (0, 6)])
def test_save_state_mid_epoch_resumes_exactly(num_workers, save_at):
    # 6 batches an epoch: step 8 is epoch 1's batch 2; step 6 ends epoch 0 (the state starts epoch 1)
    full, _ = train(tp.DataLoader, num_workers, epochs=3, save_at=save_at)
    resumed, _ = train(tp.DataLoader, num_workers, epochs=3, load_from=os.environ["TP_TEST_STATE"])
    assert resumed == full[save_at:]


def test_accelerate_s_resume_recipe_with_skip_first_batches():
    def steps(load=False, skip=0):
        set_seed(0)
        accelerator = use_torchpipe(Accelerator(cpu=True))
        loader = accelerator.prepare(tp.DataLoader(Points(22), batch_size=4, shuffle=True))
        if load:
            accelerator.load_state(os.environ["TP_TEST_STATE"])
        return [b[0].tolist() for b in accelerator.skip_first_batches(loader, skip)], loader

    full, _ = train(tp.DataLoader, epochs=1, save_at=2)
    assert steps(load=True, skip=2)[0] == [
        batch for _, batch, _ in full[2:]
    ]  # load_state put it there already
    with pytest.raises(ValueError, match="resumes this epoch at batch 2"):
        steps(load=True, skip=3)
    skipped, loader = steps(skip=2)  # without a state: as Accelerate skips, on torchpipe's loader
    set_seed(0)
    torch_loader = Accelerator(cpu=True).prepare(
        torch.utils.data.DataLoader(Points(22), batch_size=4, shuffle=True)
    )
    assert skipped == [b[0].tolist() for b in accelerate.skip_first_batches(torch_loader, 2)]
    assert len(list(loader)) == 6  # the next pass is whole


def test_a_pipeline_is_kept_and_resumed():
    def run(load=False, save_at=None):
        set_seed(0)
        accelerator = use_torchpipe(Accelerator(cpu=True))
        model = torch.nn.Linear(1, 1)
        loader = tp.DataLoader(
            tp.range(20).shuffle(20, seed=1).map(lambda x: torch.tensor([float(x)])), batch_size=3
        )
        model, loader = accelerator.prepare(model, loader)
        if load:
            accelerator.load_state(os.environ["TP_TEST_STATE"])
        seen = []
        for batch in loader:
            seen.append(batch.squeeze(1).tolist())
            if len(seen) == save_at:
                accelerator.save_state(os.environ["TP_TEST_STATE"])
            accelerator.wait_for_everyone()  # rank 0 has written it (the test loads it next)
        return seen, loader

    full, loader = run(save_at=3)
    assert isinstance(loader, AcceleratedDataLoader) and isinstance(loader.dataset, tp.Dataset)
    assert sorted(x for batch in full for x in batch) == list(range(20))
    assert run(load=True)[0] == full[3:]


@pytest.mark.parametrize("dispatch", [None, False])
def test_an_iterable_dataset_is_kept_and_resumed(dispatch):
    full, loader = stream_batches(True, 11, save_at=2, dispatch=dispatch)
    assert isinstance(loader, AcceleratedDataLoader)
    assert full == stream_batches(False, 11)[0] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]]
    assert stream_batches(True, 11, load=True, dispatch=dispatch)[0] == full[2:]


def test_a_plain_prepare_warns_once_naming_the_supported_path():
    loader = tp.DataLoader(Points(8), batch_size=2)
    accelerator = Accelerator(cpu=True)
    rebuilt = r"accelerate\.data_loader is rebuilding a torchpipe\.DataLoader.*use_torchpipe"
    with pytest.warns(UserWarning, match=rebuilt) as caught:
        prepared = accelerator.prepare(loader)
    assert caught[0].filename == __file__  # the user's line, not Accelerate's
    assert type(prepared.base_dataloader) is torch.utils.data.DataLoader
    with no_rebuild_warning():
        accelerator.prepare(tp.DataLoader(Points(8), batch_size=2))  # once a process


def test_normal_use_never_warns():
    with no_rebuild_warning():
        for workers in (0, 2):
            loader = tp.DataLoader(Points(8), batch_size=2, num_workers=workers)
            assert len(list(loader)) == 4
            assert loader.multiprocessing_context is None
        use_torchpipe(Accelerator(cpu=True)).prepare(tp.DataLoader(Points(8), batch_size=2))
    assert not rebuild.warned


def test_gradient_accumulation_knows_the_epoch_s_last_batch():
    accelerator = use_torchpipe(Accelerator(cpu=True))
    loader = accelerator.prepare(tp.DataLoader(Points(7), batch_size=2))
    for epoch in range(2):
        ends = [accelerator.gradient_state.end_of_dataloader for _ in loader]
        assert ends == [False, False, False, True] and not accelerator.gradient_state.in_dataloader
    assert loader.iteration == 2


def test_torch_loaders_stay_torch_s_unless_asked():
    accelerator = use_torchpipe(Accelerator(cpu=True))
    plain = accelerator.prepare(torch.utils.data.DataLoader(Points(8), batch_size=2))
    assert not isinstance(plain, tp.DataLoader)
    made = use_torchpipe(accelerator, num_workers="auto").prepare(
        torch.utils.data.DataLoader(Points(8), batch_size=2)
    )
    assert isinstance(made, AcceleratedDataLoader)
    assert [b[0].tolist() for b in made] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert "measured" in made.stats()[0]  # what a num_workers="auto" loader reports


# transformers' Trainer


def trainer_losses(output_dir, torchpipe=True, resume=None, max_steps=10, own_loader=False):
    transformers = pytest.importorskip("transformers")
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    class Loaders(TrainerCallback):
        def __init__(self):
            self.types = []

        def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
            self.types.append(type(train_dataloader))

    class TorchpipeTrainer(TrainerMixin, Trainer):
        def get_train_dataloader(self):
            if not own_loader:
                return super().get_train_dataloader()
            loader = tp.DataLoader(
                self.train_dataset,
                batch_size=4,
                shuffle=True,
                num_workers=2,
                collate_fn=transformers.default_data_collator,
            )
            return self.accelerator.prepare(loader)

    transformers.logging.set_verbosity_error()
    set_seed(0)
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        num_labels=2,
    )
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        max_steps=max_steps,
        logging_steps=1,
        save_steps=4,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    loaders = Loaders()
    trainer = (TorchpipeTrainer if torchpipe else Trainer)(
        model=BertForSequenceClassification(config),
        args=args,
        train_dataset=Tokens(24),
        callbacks=[loaders],
    )
    trainer.train(resume_from_checkpoint=resume)
    return [
        (h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h
    ], loaders.types[-1]


@pytest.mark.timeout(120)
def test_trainer_keeps_torchpipe_with_torch_s_losses_and_resumes(tmp_path):
    losses, loader_type = trainer_losses(tmp_path / "tp")
    assert issubclass(loader_type, AcceleratedDataLoader)
    expected, torch_type = trainer_losses(tmp_path / "torch", torchpipe=False)
    assert not issubclass(torch_type, tp.DataLoader)
    assert losses == expected and len(losses) == 10
    # checkpoint-4: epoch 0 (6 steps), batch 4; the resumed run crosses into epoch 1
    assert os.path.exists(tmp_path / "tp" / "checkpoint-4" / "torchpipe_loader_0.pt")
    resumed, _ = trainer_losses(tmp_path / "tp", resume=str(tmp_path / "tp" / "checkpoint-4"))
    assert [step for step in resumed if step[0] > 4] == losses[
        4:
    ]  # the history up to 4 is the checkpoint's


def test_a_trainer_s_own_tp_loader_is_kept(tmp_path):
    with no_rebuild_warning():
        losses, loader_type = trainer_losses(tmp_path, own_loader=True, max_steps=4)
    assert issubclass(loader_type, AcceleratedDataLoader) and len(losses) == 4


# two ranks


def rank_main(folder: str) -> None:
    """What each rank runs (started by test_two_gloo_ranks): its results pickled into ``folder``."""
    rank = int(os.environ["RANK"])
    os.environ["TP_TEST_STATE"] = os.path.join(folder, "state")
    results = {}
    results["torch"], _ = train(torch.utils.data.DataLoader, patched=False, n=26)
    results["tp"], loader = train(tp.DataLoader, n=26, epochs=3, save_at=5)
    results["type"] = type(loader).__name__
    results["resumed"], _ = train(
        tp.DataLoader, n=26, epochs=3, load_from=os.environ["TP_TEST_STATE"]
    )
    os.environ["TP_TEST_STATE"] = os.path.join(folder, "stream_state")  # not the state above
    results["stream"], _ = stream_batches(True, 14, save_at=1)
    results["stream_torch"], _ = stream_batches(False, 14)
    results["stream_resumed"], _ = stream_batches(True, 14, load=True)
    if os.environ.get("TP_TEST_TRAINER"):
        trainer = os.path.join(folder, "trainer")
        results["trainer"], results["trainer_type"] = trainer_losses(trainer, max_steps=6)
        results["trainer_torch"], _ = trainer_losses(
            trainer + "_torch", torchpipe=False, max_steps=6
        )
        checkpoint = os.path.join(trainer, "checkpoint-4")
        results["trainer_resumed"], _ = trainer_losses(trainer, max_steps=6, resume=checkpoint)
    with open(os.path.join(folder, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    # torch 2.13's gloo + DDP processes now and then abort at interpreter teardown ("terminate called
    # without an active exception", tests/distributed/test_gloo_ranks.py): the results are written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.timeout(120)
def test_two_gloo_ranks_get_accelerate_s_shards_and_resume(tmp_path):
    port = free_port()
    ranks = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "TP_TEST_TRAINER": "1",
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        script = f"from tests.integrations.test_accelerate import rank_main; rank_main({str(tmp_path)!r})"
        ranks.append(
            subprocess.Popen(
                [sys.executable, "-c", script],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [process.communicate(timeout=100)[0] for process in ranks]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    assert all(process.returncode == 0 for process in ranks), "\n".join(o[-3000:] for o in outputs)
    results = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    for result in results:
        assert result["type"] == "AcceleratedDataLoader"
        # Accelerate's own shard, step for step
        assert result["tp"][: len(result["torch"])] == result["torch"]
        assert result["resumed"] == result["tp"][5:]
        # 24 examples, 4 a batch, 2 ranks: 3 steps an epoch; checkpoint-4 is mid-epoch 1
        if "trainer" in result:
            assert issubclass(result["trainer_type"], AcceleratedDataLoader)
            assert result["trainer"] == result["trainer_torch"] and len(result["trainer"]) == 6
            assert [step for step in result["trainer_resumed"] if step[0] > 4] == result["trainer"][
                4:
            ]
    streams = [result["stream"] for result in results]
    assert streams == [result["stream_torch"] for result in results]  # IterableDatasetShard's split
    assert [result["stream_resumed"] for result in results] == [stream[1:] for stream in streams]
    assert sorted({x for stream in streams for batch in stream for x in batch}) == list(range(14))
    # 26 elements, 4 a batch, 2 ranks: 4 steps, the last batches padded from the start
    for epoch in range(3):
        seen = [x for r in results for e, batch, _ in r["tp"] if e == epoch for x in batch]
        assert len(seen) == 32 and set(seen) == set(range(26))
