"""``schedule="layered"``: gpipe with the layer-major backward of layered gradient accumulation ([Note: layered
backward]) -- one device's result in float64, gpipe's bit for bit with replicas, each block's reduction started
while the blocks before it still run the whole mini-batch."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_paci import PACIStrategy, build_schedule

from helpers import fit
from models import (
    HFCausalLM,
    SequentialMLP,
    hf_reference_accumulation,
    reference_accumulation,
    regression_loader,
    token_loader,
)

pytestmark = pytest.mark.distributed


class DoubleMLP(SequentialMLP):
    def __init__(self) -> None:
        super().__init__(depth=6)
        self.double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return super().training_step((x.double(), y.double()), batch_idx)


class RecordLayers(L.Callback):
    """Every rank writes: mini-batches run layer-major, cuts per micro-batch, buckets started during a backward."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runtime = trainer.strategy.runtime
        started = getattr(runtime.reduce_gradients, "started_in_backward", 0)
        figures = [runtime.layered.groups, runtime.layered.depth, started]
        (self.directory / f"layers{trainer.global_rank}.txt").write_text(" ".join(map(str, figures)))

    def read(self, ranks: int) -> list[list[int]]:
        return [list(map(int, (self.directory / f"layers{r}.txt").read_text().split())) for r in range(ranks)]


def test_the_layered_backward_equals_one_device_in_float64(tmp_path):
    torch.manual_seed(3)
    model = DoubleMLP()
    reference = copy.deepcopy(model)
    loader = regression_loader(num_batches=4, batch_size=8)
    record = RecordLayers(tmp_path)
    fit(model, loader, devices=3, max_steps=3, schedule="layered", microbatches=4, partition="parameters",
        callbacks=[record])
    reference_accumulation(reference, [(x.double(), y.double()) for x, y in loader], num_microbatches=4, num_steps=3)
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    # 11 blocks (Linear, Tanh, ...) over 3 stages; every block's entry and exit cut on every micro-batch
    assert [groups for groups, _, _ in record.read(3)] == [3, 3, 3]
    assert sum(depth for _, depth, _ in record.read(3)) == 2 * 11 - 1  # stage 0's first block: its input is data


def test_a_transformers_model_trains_layer_major_as_on_one_device():
    torch.manual_seed(10)
    model = HFCausalLM("gpt2", layers=4)
    reference = copy.deepcopy(model)
    loader = token_loader(num_batches=4, vocab=64, seq=12)
    fit(model, loader, devices=2, max_steps=3, schedule="layered", microbatches=4)
    hf_reference_accumulation(reference, list(loader)[:3], num_microbatches=4)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_with_replicas_the_layered_backward_is_gpipes_bit_for_bit_and_reduces_during_it(tmp_path):
    torch.manual_seed(6)
    model = SequentialMLP(depth=6)
    gpipe = copy.deepcopy(model)
    loader = regression_loader(num_batches=12, batch_size=8)
    shape = dict(devices=4, max_steps=3, microbatches=4, data_parallel_size=2, reduce_bucket_mb=1e-6,
                 partition="parameters", trainer_kwargs={"use_distributed_sampler": True})
    record = RecordLayers(tmp_path)
    fit(model, loader, schedule="layered", callbacks=[record], **shape)
    fit(gpipe, loader, schedule="gpipe", **shape)
    for key, value in gpipe.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert all(started > 0 for _, _, started in record.read(4))  # buckets started inside the layer-major pass


def test_the_layered_lists_receive_every_gradient_before_the_backwards_and_need_whole_batches():
    actions = [f"{a.kind}{'' if a.microbatch is None else a.microbatch}" for a in
               build_schedule("layered", 3, 2, 2, 1).actions[1]]
    assert actions[6:] == [f"{k}{i}" for k, i in [("RECV_B", 0), ("RECV_B", 1), ("B", 0), ("B", 1), ("SEND_B", 0),
                                                   ("SEND_B", 1)]] + ["OPT"]
    with pytest.raises(ValueError, match=r"`schedule='layered'` steps after whole mini-batches .* `accumulation` must "
                                         r"be a multiple of `microbatches` \(4\), got 6"):
        build_schedule("layered", 2, 4, 6, 2)
    with pytest.raises(ValueError, match=r"`recompute='blocks'` recomputes those blocks"):
        PACIStrategy(schedule="layered", recompute="blocks")


class CountHooks(L.Callback):
    """Every rank writes how many forward hooks its module holds during training and when the run ends."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _count(self, module: torch.nn.Module) -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.during = self._count(pl_module)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        after = self._count(pl_module)
        (self.directory / f"hooks{trainer.global_rank}.txt").write_text(f"{self.during} {after}")


def test_the_block_hooks_are_removed_when_the_run_ends(tmp_path):
    fit(SequentialMLP(depth=4), regression_loader(num_batches=2), devices=2, max_steps=1, schedule="layered",
        microbatches=2, partition="parameters", callbacks=[CountHooks(tmp_path)])
    counts = [tuple(map(int, (tmp_path / f"hooks{r}.txt").read_text().split())) for r in range(2)]
    assert all(during >= 2 for during, _ in counts)  # each stage's blocks are hooked while it trains
    assert all(after == 0 for _, after in counts), counts


class _Sent:
    """A reduction over one replica: nothing to wait for."""

    def wait(self) -> bool:
        return True


def test_a_gradient_accumulated_after_its_buckets_reduction_started_is_named_at_the_step():
    # one replica, the reduction the identity; the hooks expect one accumulation per parameter in the closing
    # backward, and `shared` receives a second one from another backward run inside it
    from lightning_paci.engine.replicas.grad_buckets import OverlappedGradientAverage

    shared, other = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    average = OverlappedGradientAverage([shared, other], None, 1, buckets=[[0], [1]], first_late=2,
                                        names=["shared", "other"], all_reduce=lambda flat: _Sent())
    average.arm()
    (shared * 2).sum().backward()  # bucket 0 starts
    (shared * other).sum().backward()  # shared again, and other: bucket 1 starts
    assert average.started_in_backward == 2
    with pytest.raises(RuntimeError, match=r"shared received more gradient in the backward that closes a window"):
        average()
    average.arm(times=2)  # the next window, layer-major over two micro-batches: no error
    for _ in range(2):
        (shared * other).sum().backward()
    average()
    # the failed window wrote nothing back: 2 + 1 from it, then 1 + 1, packed after the second accumulation
    torch.testing.assert_close(shared.grad, torch.full((2,), 5.0))
