"""PACIConfig: every option checked at construction, the message naming the argument, the value and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_paci import PACIStrategy
from lightning_paci.config import PACIConfig


@pytest.mark.parametrize("options, message", [
    ({"schedule": "zb"}, r"`schedule` must be one of 'paci', '1f1b', 'gpipe', 'layered', 'interleaved', 'bfs', "
                         r"got 'zb'"),
    ({"microbatches": 0}, r"`microbatches` must be an int >= 1 \(or None for the default\), got 0\. Use e\.g\."),
    ({"accumulation": True}, r"`accumulation` must be an int >= 1 .*got True"),
    ({"nonfinite": "ignore"}, r"`nonfinite` must be one of 'raise', 'skip', got 'ignore'"),
    ({"checkpoint_layout": "zip"}, r"`checkpoint_layout` must be one of 'auto', 'consolidated', 'sharded', got 'zip'"),
    ({"checkpoint_layout": "consolidated", "tensor_parallel_size": 2}, r"`checkpoint_layout='consolidated'` with "
                                                                       r"`tensor_parallel_size=2`: a stage's DTensor "
                                                                       r"shards are not gathered.*Use "
                                                                       r"`checkpoint_layout='sharded'`"),
    ({"max_stream_batches": 0}, r"`max_stream_batches` must be an int >= 1, got 0\. The default 256"),
    ({"freeze_gc": "yes"}, r"`freeze_gc` must be True or False, got 'yes'"),
    ({"failure_timeout": 0}, r"`failure_timeout` must be > 0 seconds, got 0\. The default 20\.0"),
    ({"start_method": "thread"}, r"`start_method` must be one of 'popen', 'spawn', 'fork', 'forkserver'"),
    ({"virtual_stages": 0}, r"`virtual_stages` must be an int >= 1, got 0\. Use e\.g\. `virtual_stages=2`"),
    ({"placement": "zigzag"}, r"`placement` must be one of 'loop', 'v', got 'zigzag'"),
    ({"schedule": "1f1b", "virtual_stages": 2}, r"`schedule='1f1b'` runs one stage per device, got "
                                                r"`virtual_stages=2`: use `schedule='interleaved'`"),
    ({"schedule": "layered", "virtual_stages": 2}, r"use `schedule='bfs'`"),
    ({"partition": "even"}, r"`partition` must be one of 'parameters', 'time', 'balanced', 'uniform', got 'even'"),
    ({"partition": [4, 2]}, r"`partition=\[4, 2\]` must be .* the strictly increasing block indices \(>= 1\)"),
    ({"partition": [0, 3]}, r"`partition=\[0, 3\]` must be"),
    ({"partition": [2.0]}, r"`partition=\[2\.0\]` must be"),
    ({"block_container": ["model.layers", 3]}, r"`block_container=\['model\.layers', 3\]` must be None"),
    ({"block_container": 7}, r"`block_container=7` must be None"),
    ({"process_group_backend": "mpi"}, r"`process_group_backend='mpi'`: the pipeline's messages run on 'gloo' or "
                                       r"'nccl'"),
    ({"timeout": 5}, r"`timeout=5` must be a positive `datetime\.timedelta`"),
    ({"compile": "blocks", "compile_backend": "cudagraphs"}, r"`compile_backend='cudagraphs'`: CUDA graphs reuse "
                                                             r"their output memory at every replay"),
    ({"plan": "fast"}, r"`plan` must be one of 'off', 'auto', got 'fast'"),
    ({"plan": "auto", "memory_budget": "lots"}, r"`memory_budget='lots'` must be a positive number of bytes or a "
                                                r"size such as '24GiB'"),
    ({"plan": "auto", "memory_budget": -1}, r"`memory_budget=-1` must be a positive number of bytes"),
    ({"memory_budget": "8GiB"}, r"`memory_budget='8GiB'` bounds the plan `plan='auto'` chooses; pass "
                                r"`plan='auto'` with it"),
])
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=message):
        PACIConfig(**options)
    with pytest.raises(ValueError, match=message):  # the strategy checks through the same dataclass
        PACIStrategy(**options)


def test_a_memory_budget_is_read_in_bytes_from_a_number_or_a_size():
    assert PACIConfig(plan="auto", memory_budget="24GiB").memory_budget == 24 * 2**30
    assert PACIConfig(plan="auto", memory_budget="500 MB").memory_budget == 500e6
    assert PACIConfig(plan="auto", memory_budget=1e9).memory_budget == 1e9


def test_good_partition_options_are_kept_as_given():
    assert PACIConfig(partition=(2, 5)).partition == (2, 5)
    assert PACIConfig(block_container=["model.encoder.layers", "model.decoder.layers"]).block_container == (
        "model.encoder.layers", "model.decoder.layers")
    assert PACIConfig(block_container="model.layers", process_group_backend="gloo").block_container == "model.layers"


def test_the_config_is_frozen_and_derives_variants():
    config = PACIConfig(microbatches=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.microbatches = 4  # type: ignore[misc]
    assert dataclasses.replace(config, schedule="1f1b").microbatches == 8
    assert PACIStrategy(microbatches=8, schedule="1f1b").config == dataclasses.replace(config, schedule="1f1b")


def test_the_strategys_pipeline_options_are_the_configs_fields():
    # PACIStrategy spells its options out (for IDEs and LightningCLI) and builds PACIConfig from them: the same names,
    # defaults and annotations, in the same order, besides Lightning's own strategy arguments
    import inspect

    lightning_args = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
    params = [p for p in inspect.signature(PACIStrategy).parameters.values() if p.name not in lightning_args]
    fields = dataclasses.fields(PACIConfig)
    assert [p.name for p in params] == [f.name for f in fields]
    assert [p.default for p in params] == [f.default for f in fields]
    assert [str(p.annotation) for p in params] == [str(f.type) for f in fields]
    assert PACIStrategy().config == PACIConfig()


def test_the_old_compensation_name_is_weight_prediction_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match=r"`compensation='lookahead'` is `compensation='predict'`"):
        config = PACIConfig(compensation="lookahead")  # type: ignore[arg-type]
    assert config.compensation == "predict"


def test_the_checkpoint_layout_auto_is_sharded_with_the_modules_own_parallelism_else_one_file():
    assert PACIConfig().checkpoint_layout == "consolidated"
    assert PACIConfig(tensor_parallel_size=1).checkpoint_layout == "sharded"
    assert PACIConfig(checkpoint_layout="sharded").checkpoint_layout == "sharded"
