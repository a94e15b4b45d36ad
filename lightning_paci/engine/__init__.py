"""The engine: everything that runs a pipeline stage, with no Lightning anywhere below it.

A stage is a :class:`~lightning_paci.engine.runtime.StageRuntime` executing its action list (built by
:mod:`lightning_paci.schedules`) one action at a time: forwards and backwards through a
:class:`~lightning_paci.engine.program.StageProgram` (what the model's side provides), messages through a
:class:`~lightning_paci.engine.comm.Comm`, local updates through the stage optimizer (:mod:`lightning_paci.optim`).

* ``runtime.py``: one handler per action kind, per-micro-batch random streams, a backward's hooks after its send;
* ``program.py``: the stage-program protocol, a forward's result, log records, the loss read without a host sync;
* ``messages.py``: a message's structure (skeleton and tensors); ``comm.py``: point-to-point messages over process
  groups, receives posted ahead; ``split_wire.py``: under NCCL, headers on a host side channel and payloads on the
  device; ``communicators.py``: the layout's groups, created and connected at setup; ``pickle_guard.py``: no
  tensor through pickle;
* ``microbatch.py``: splitting a batch, loss weights and scales, merging outputs;
* ``records.py``: bounded per-stage records and meters, read by the monitors;
* ``cursor.py`` and ``driver.py``: a stream of batches cut into per-call rounds, drains;
* ``reference.py``: the one-process executor of all stages' lists and its in-process mailboxes;
* ``data_parallel.py``: the replicas' gradient and parameter averages;
* ``recompute.py``: activation recomputation of a stage's blocks;
* ``topology.py``: stages x replicas over the ranks; ``supervision.py``: the failure watchdog and setup errors;
  ``lost_peers.py``: who is gone when a connection is lost; ``preemption.py``: the batch every process stops
  before on a SIGTERM.

The rule of this package: nothing in it imports ``lightning`` (or ``pytorch_lightning``), directly or through
another module; ``tests/test_layout.py`` walks the imports to keep it so. The Lightning integration
(:mod:`lightning_paci.integration`) builds these objects from a LightningModule and a Trainer.
"""

__all__: list[str] = []
