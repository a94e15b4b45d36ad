"""The engine: everything that runs a pipeline stage, with no Lightning anywhere below it.

A stage is a :class:`~lightning_paci.engine.runtime.runtime.StageRuntime` executing its action list (built by
:mod:`lightning_paci.schedules`) one action at a time: forwards and backwards through a
:class:`~lightning_paci.engine.runtime.program.StageProgram` (what the model's side provides), messages through a
:class:`~lightning_paci.engine.transport.point_to_point.Comm`, local updates through the stage optimizer
(:mod:`lightning_paci.optim`). The folders, each importing only the ones listed after it:

* ``streams/``: a stream of Lightning batches cut into per-call rounds of a stage's list, and its drains;
* ``blocks/``: what runs a stage's own blocks differently: compiled, recomputed, or layer by layer backwards;
* ``runtime/``: one stage's action list executed, its counters, records and device clocks, the reference executor;
* ``replicas/``: stages x replicas over the ranks, the replicas' gradient averages, buckets and optimizer shards;
* ``transport/``: messages, their wire format, point-to-point links, process groups, collectives, in-process
  mailboxes, the pickle guard and the NCCL emulation;
* ``supervision/``: the failure watchdog, what this process is doing, who is gone, where a preempted run stops.

The rule of this package: nothing in it imports ``lightning`` (or ``pytorch_lightning``), directly or through
another module; ``tests/test_layout.py`` walks the imports to keep it so. The Lightning integration
(:mod:`lightning_paci.integration`) builds these objects from a LightningModule and a Trainer.
"""

__all__: list[str] = []
