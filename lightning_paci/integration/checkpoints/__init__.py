"""Checkpoints of a pipeline: one ordinary Lightning file, one file per stage, or a distributed checkpoint.

* ``checkpoint.py``: the format: the stages' weights and optimizer states by name, gathered or sharded, atomic
  writes, what a fork/spawn run hands back after ``fit``;
* ``distributed_checkpoint.py``: stages with their own parallelism (DTensor shards): one
  ``torch.distributed.checkpoint`` directory written by every rank, resumable on another layout;
* ``checkpoint_hooks.py``: ``CheckpointHooks``, what the strategy's checkpoint hooks do;
* ``one_device_optimizer.py``: one device's optimizer param groups by name, so checkpoints resume on one device
  and back.
"""

__all__: list[str] = []
