"""Big models: built on the meta device, each stage materializing only its own parameters -- replayed from the
user's own initialization bit for bit, or read per stage from pretrained weights -- and no full gather."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.multiprocessing import ProcessRaisedException

from lightning_paci import PACIStrategy, SavePretrained
from lightning_paci.integration.checkpoints.checkpoint import load_sharded
from lightning_paci.partition.stage_init import (
    Recording,
    generator_states,
    owned_registrations,
    replay,
    rewind_point,
)
from lightning_paci.partition.weights import WeightsError, WeightsFile, match_names

from helpers import fit, one_device
from models import LaterLoopTransformer, LoopTransformer, PretrainedGPT2, token_loader

pytestmark = pytest.mark.timeout(240)


class DumpWeights(L.Callback):
    """Rank 0 saves the whole trained state (the consolidated gather); every rank records what it holds."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def on_train_start(self, trainer, pl_module) -> None:
        s = trainer.strategy.stage_index
        held = {n: not p.is_meta for n, p in pl_module.named_parameters()}
        report = {"held": sorted(n for n, real in held.items() if real),
                  "params": sum(p.numel() for p in pl_module.parameters() if not p.is_meta),
                  "plan": trainer.strategy.plan.stage_params[s], "weights_read": trainer.strategy.weights_read}
        (self.directory / f"start{s}.json").write_text(json.dumps(report))

    def on_train_end(self, trainer, pl_module) -> None:
        state = trainer.strategy.lightning_module_state_dict()
        if trainer.is_global_zero:
            torch.save(state, self.directory / "weights.pt")

    def weights(self) -> dict[str, torch.Tensor]:
        return torch.load(self.directory / "weights.pt")

    def start(self, stage: int) -> dict:
        return json.loads((self.directory / f"start{stage}.json").read_text())


def _assert_equal_states(actual: dict, expected: dict, **tol) -> None:
    assert actual.keys() == expected.keys(), actual.keys() ^ expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], **(tol or {"rtol": 0, "atol": 0}),
                                   msg=lambda m, key=key: f"{key}: {m}")


# -- the replay, without a Trainer -------------------------------------------------------------------------------

class _Inits(nn.Module):
    """Initializers of every kind: module defaults, the ones that return early on meta, a tensor made real."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 12)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(12, 12), nn.LayerNorm(12)) for _ in range(4)])
        for block in self.blocks:
            nn.init.trunc_normal_(block[0].weight, std=0.02)
            nn.init.orthogonal_(block[0].weight)
            block[0].bias.data.normal_()
        self.scale = nn.Parameter(torch.randn(12) * 0.1)
        self.register_buffer("mask", torch.tril(torch.ones(6, 6)))


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


@pytest.mark.parametrize("build", [_Inits, _gpt2], ids=["torch-inits", "gpt2-tied"])
def test_replay_gives_the_ordinary_bits_and_leaves_the_generator_where_an_ordinary_build_does(build) -> None:
    torch.manual_seed(3)
    ordinary = build()
    after_ordinary = torch.rand(4)

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = build()

    holder = Holder()
    torch.manual_seed(3)
    recording, restore, rewind = Recording(lambda: True), generator_states(), rewind_point(holder)
    with recording.recording():
        holder.configure_model()
    assert all(p.is_meta for p in holder.parameters())
    assert not any(b.is_meta for b in holder.buffers())  # masks keep their values
    restore()

    def owned(name: str) -> bool:  # "a stage": block 1 and the head (GPT-2's head is tied to the embedding)
        return ".1." in name or "head" in name

    keep = owned_registrations(recording.params, holder, owned)
    rewind()
    with replay(recording.params, keep, torch.device("cpu")):
        holder.configure_model()
    torch.testing.assert_close(torch.rand(4), after_ordinary, rtol=0, atol=0)  # the same draws were made
    expected = dict(ordinary.named_parameters(remove_duplicate=False))
    real = [n for n, p in holder.named_parameters(remove_duplicate=False) if not p.is_meta]
    assert real and all(owned(n) or n.endswith("wte.weight") for n in real), real
    for name in real:
        torch.testing.assert_close(holder.get_parameter(name), expected[name.removeprefix("model.")], rtol=0, atol=0)
    assert any(p.is_meta for p in holder.parameters())


# -- through the Trainer ------------------------------------------------------------------------------------------

def test_configure_model_trains_bit_for_bit_like_init_and_each_stage_holds_only_its_own(tmp_path) -> None:
    runs = {}
    for name, cls in (("init", LoopTransformer), ("configure_model", LaterLoopTransformer)):
        dump = DumpWeights(tmp_path / name)
        dump.directory.mkdir()
        L.seed_everything(0)
        fit(cls(layers=4), token_loader(), devices=4, max_steps=4, callbacks=[dump], partition="parameters")
        runs[name] = dump
    _assert_equal_states(runs["configure_model"].weights(), runs["init"].weights())
    for s in range(4):
        start = runs["configure_model"].start(s)
        assert start["params"] == start["plan"]  # the stage's parameters only, nothing of the others


class SGDLater(LaterLoopTransformer):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_configure_model_under_1f1b_equals_one_device(tmp_path) -> None:
    dump = DumpWeights(tmp_path)
    L.seed_everything(0)
    fit(SGDLater(layers=4), token_loader(), devices=4, max_steps=4, callbacks=[dump], partition="parameters",
        schedule="1f1b")
    L.seed_everything(0)
    single = SGDLater(layers=4)
    one_device(max_steps=4, accumulate_grad_batches=1).fit(single, token_loader())
    # one device: the whole batch at once; the pipeline: 4 micro-batches whose mean loss is the batch's
    _assert_equal_states(dump.weights(), {k: v for k, v in single.state_dict().items()}, rtol=1e-5, atol=1e-6)


def test_plan_auto_measures_a_configure_model_build_on_rank_zero_and_still_equals_one_device(tmp_path) -> None:
    dump = DumpWeights(tmp_path / "run")
    dump.directory.mkdir()
    L.seed_everything(0)
    fit(SGDLater(layers=4), token_loader(), devices=2, max_steps=3, callbacks=[dump], plan="auto", schedule="1f1b",
        trainer_kwargs={"default_root_dir": tmp_path})
    assert list((tmp_path / "paci_plan").glob("costs-*.json")) and (tmp_path / "paci_plan" / "plan.png").is_file()
    L.seed_everything(0)
    single = SGDLater(layers=4)
    one_device(max_steps=3, accumulate_grad_batches=1).fit(single, token_loader())
    _assert_equal_states(dump.weights(), {k: v for k, v in single.state_dict().items()}, rtol=1e-5, atol=1e-6)
    for s in range(2):
        start = dump.start(s)
        assert start["params"] == start["plan"]  # rank 0 measured the whole model, then kept its stage only


def _pretrained_directory(path: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(11)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    GPT2LMHeadModel(config).save_pretrained(path, max_shard_size="40KB")  # several files and an index
    return path


def test_weights_per_stage_train_like_from_pretrained_and_export_reloads(tmp_path) -> None:
    from transformers import GPT2LMHeadModel

    directory = _pretrained_directory(tmp_path / "pretrained")
    files = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(files.values())) >= 3
    loader = token_loader(vocab=64, seq=9)
    ordinary, staged = DumpWeights(tmp_path / "ordinary"), DumpWeights(tmp_path / "staged")
    for dump in (ordinary, staged):
        dump.directory.mkdir()
    L.seed_everything(0)
    fit(PretrainedGPT2(directory, load_now=True), loader, devices=3, max_steps=3, callbacks=[ordinary],
        partition="parameters")
    L.seed_everything(0)
    fit(PretrainedGPT2(directory, load_now=False), loader, devices=3, max_steps=3, partition="parameters",
        weights=str(directory), callbacks=[staged, SavePretrained(tmp_path / "export")])
    _assert_equal_states(staged.weights(), ordinary.weights())
    for s in range(3):
        start = staged.start(s)
        read, held = start["weights_read"], {n.removeprefix("model.") for n in start["held"]}
        tie = {"lm_head.weight": "transformer.wte.weight"}
        assert sorted(read["keys"]) == sorted({tie.get(n, n) for n in held})  # its own keys, nothing else
        assert set(read["files"]) == {files[k] for k in read["keys"]}  # only the files that hold them
    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "export")
    trained = staged.weights()
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, trained[f"model.{name}"], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_weights_mismatches_are_named() -> None:
    names = ["model.a.weight", "model.b.weight", "model.b.bias", "model.head.weight"]
    aliases = {"model.head.weight": ["model.a.weight"], "model.a.weight": ["model.head.weight"]}
    prefix, mapping = match_names(names, aliases, [], {"a.weight", "b.weight", "b.bias"}, path="p")
    assert prefix == "model." and mapping["model.head.weight"] == "a.weight"  # the tie filled from its owner
    with pytest.raises(WeightsError, match=r"missing .*model\.b\.bias") as err:
        match_names(names, aliases, [], {"a.weight", "b.weight"}, path="p")
    assert "prefix 'model.'" in str(err.value)
    with pytest.raises(WeightsError, match=r"unexpected .*: b\.extra"):
        match_names(names, aliases, [], {"a.weight", "b.weight", "b.bias", "b.extra"}, path="p")
    with pytest.raises(WeightsError, match="missing .*unexpected .*gpt.a.weight"):  # a wrong prefix
        match_names(names, aliases, [], {"gpt.a.weight", "gpt.b.weight", "gpt.b.bias"}, path="p")


class LoadsInConfigureModel(LaterLoopTransformer):
    def __init__(self, state, **kwargs) -> None:
        super().__init__(**kwargs)
        self.state = state  # a state dict from elsewhere (a file, or a model built inside the hook)

    def configure_model(self) -> None:
        super().configure_model()
        self.load_state_dict(self.state() if callable(self.state) else self.state)


@pytest.mark.parametrize("where", ["real tensors", "built in the hook"])
def test_load_state_dict_into_the_meta_model_is_refused_naming_the_fix(where) -> None:
    state = LoopTransformer(layers=4).state_dict() if where == "real tensors" else \
        (lambda: LoopTransformer(layers=4).state_dict())
    with pytest.raises(ProcessRaisedException, match=r"meta parameters .* `PACIStrategy\(weights=PATH\)`"):
        fit(LoadsInConfigureModel(state, layers=4), token_loader(), devices=2, max_steps=1, partition="parameters")


def test_a_missing_weights_path_is_refused_at_construction(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"`weights='.*nowhere'` does not exist"):
        PACIStrategy(weights=tmp_path / "nowhere")


def test_sharded_checkpoint_with_a_pickled_object_is_refused_under_weights_only(tmp_path) -> None:
    torch.save({"paci_num_stages": 1, "hyper": _Pickled()}, tmp_path / "meta.pt")
    torch.save({"state_dict": {"w": torch.ones(2)}, "optimizer": {}}, tmp_path / "stage_000.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_sharded(tmp_path, weights_only=True)
    assert load_sharded(tmp_path, weights_only=False)["state_dict"]["w"].sum() == 2  # the caller allowed it
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):  # weights= never unpickles code
        WeightsFile.open(tmp_path / "meta.pt")
    torch.save({"epoch": 3}, tmp_path / "plain.ckpt")
    with pytest.raises(WeightsError, match="no state dict of tensors"):
        WeightsFile.open(tmp_path / "plain.ckpt")


class _Pickled:
    """Not a tensor nor a plain container: what a checkpoint from elsewhere could carry to run code."""


# -- `trainer.init_module(empty_init=True)`: parameters on meta, values from weights= or the modules' own resets ---

def _trainer(devices: int, callbacks=(), max_steps: int = 3, max_epochs: int | None = None, **strategy) -> L.Trainer:
    from datetime import timedelta

    return L.Trainer(strategy=PACIStrategy(start_method="fork", timeout=timedelta(seconds=60), partition="parameters",
                                           **strategy),
                     accelerator="cpu", devices=devices, max_steps=max_steps, max_epochs=max_epochs, logger=False,
                     enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks),
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=0, use_distributed_sampler=False, callbacks=list(callbacks))


def test_init_module_empty_init_takes_each_stage_from_a_checkpoint_file(tmp_path) -> None:
    torch.manual_seed(5)
    pretrained = LoopTransformer(layers=4)
    torch.save({"state_dict": pretrained.state_dict(), "epoch": 0}, tmp_path / "pretrained.ckpt")
    ordinary, staged = DumpWeights(tmp_path / "ordinary"), DumpWeights(tmp_path / "staged")
    for dump in (ordinary, staged):
        dump.directory.mkdir()
    model = LoopTransformer(layers=4)
    model.load_state_dict(pretrained.state_dict())
    L.seed_everything(0)
    _trainer(4, [ordinary]).fit(model, token_loader())
    L.seed_everything(0)
    trainer = _trainer(4, [staged], weights=tmp_path / "pretrained.ckpt")
    with trainer.init_module(empty_init=True):
        empty = LoopTransformer(layers=4)
    assert all(p.is_meta for p in empty.parameters()) and not any(b.is_meta for b in empty.buffers())
    trainer.fit(empty, token_loader())
    _assert_equal_states(staged.weights(), ordinary.weights())
    assert staged.start(1)["params"] == staged.start(1)["plan"]


class InitialWeights(L.Callback):
    """Every stage saves its parameters before the first step."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def on_train_start(self, trainer, pl_module) -> None:
        own = {n: p.detach().clone() for n, p in pl_module.named_parameters() if not p.is_meta}
        torch.save(own, self.directory / f"initial{trainer.global_rank}.pt")

    def read(self, ranks: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for rank in range(ranks):
            out.update(torch.load(self.directory / f"initial{rank}.pt"))
        return out


def test_init_module_empty_init_without_weights_resets_each_module_by_name_on_any_partition(tmp_path) -> None:
    from models import SequentialMLP, regression_loader

    initial = {}
    for devices in (2, 4):
        record = InitialWeights(tmp_path)
        L.seed_everything(0)
        trainer = _trainer(devices, [record])
        with trainer.init_module(empty_init=True):
            model = SequentialMLP(depth=8)
        trainer.fit(model, regression_loader())
        initial[devices] = record.read(devices)
    _assert_equal_states(initial[4], initial[2])  # seeded by the module's name: the same on any split
    assert all(v.abs().sum() > 0 and v.isfinite().all() for v in initial[4].values())


class BareParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.scale


def test_init_module_empty_init_refuses_a_parameter_nothing_can_initialize() -> None:
    from models import SequentialMLP, regression_loader

    trainer = _trainer(2)
    with trainer.init_module(empty_init=True):
        model = SequentialMLP(depth=4)
        model.net = nn.Sequential(BareParameter(), nn.Linear(8, 16), BareParameter(), nn.Linear(16, 4))
    with pytest.raises(ProcessRaisedException, match=r"`net.[02]` \(BareParameter\) has parameters but no "
                                                     r"`reset_parameters\(\)`.*`PACIStrategy\(weights=PATH\)`"):
        trainer.fit(model, regression_loader())


@pytest.mark.parametrize("layout", ["consolidated", "sharded"])
def test_a_meta_built_model_resumes_exactly_from_its_stage_of_a_checkpoint(tmp_path, layout) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(directory: Path, epochs: int, dump: DumpWeights) -> L.Trainer:
        directory.mkdir(exist_ok=True)
        return _trainer(4, [ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="{epoch}"), dump],
                        max_steps=-1, max_epochs=epochs, checkpoint_layout=layout, microbatches=4, accumulation=3)

    loader = token_loader(num_batches=4)
    full, part = DumpWeights(tmp_path / "full"), DumpWeights(tmp_path / "part")
    L.seed_everything(0)
    trainer(tmp_path / "full", 2, full).fit(LaterLoopTransformer(layers=4), loader)
    L.seed_everything(0)
    trainer(tmp_path / "part", 1, part).fit(LaterLoopTransformer(layers=4), loader)
    resumed = DumpWeights(tmp_path / "resumed")
    L.seed_everything(1)  # a different seed: the replayed init is overwritten by the checkpoint's weights
    trainer(tmp_path / "resumed", 2, resumed).fit(LaterLoopTransformer(layers=4), loader,
                                                  ckpt_path=str(tmp_path / "part" / "epoch=0.ckpt"))
    _assert_equal_states(resumed.weights(), full.weights())


def test_weights_of_another_model_are_refused_at_setup_listing_the_keys(tmp_path) -> None:
    directory = _pretrained_directory(tmp_path / "gpt2")
    with pytest.raises(ProcessRaisedException, match=r"does not match the model's names .*missing .*tok_emb\.weight"):
        fit(LaterLoopTransformer(layers=4), token_loader(), devices=2, max_steps=1, partition="parameters",
            weights=str(directory))


def test_a_model_built_in_init_that_nears_the_hosts_memory_is_warned_about() -> None:
    from lightning_paci.integration.setup.stage_build import host_memory_warning

    model = LoopTransformer(layers=2)
    assert host_memory_warning(model, local_ranks=8) is None
    warning = host_memory_warning(model, local_ranks=10**9)  # as if a billion processes each held it
    assert warning is not None and "Build it in `LightningModule.configure_model()`" in warning


def test_save_pretrained_names_its_prefix_at_the_start_when_the_module_holds_no_such_attribute(tmp_path):
    """A module holding its network as ``self.blocks`` (not ``self.model``): refused before training, naming
    ``prefix=`` and the module's children, not an AttributeError after the run."""
    with pytest.raises(ProcessRaisedException, match=r"ValueError: `SavePretrained\(prefix='model.'\)`: "
                                                     r"LoopTransformer has no submodule 'model' \(its children: "
                                                     r"\['tok_emb', 'pos_emb', 'blocks', 'ln_f', 'head'\]\)"):
        fit(LoopTransformer(), token_loader(), devices=2, max_steps=1, callbacks=[SavePretrained(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
