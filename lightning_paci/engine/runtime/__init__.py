"""One stage's action list executed: the runtime, its state and records, and the one-process reference executor.

* ``runtime.py``: ``StageRuntime``, one handler per action kind, per-micro-batch random streams, a backward's hooks
  after its send;
* ``runtime_state.py``: ``RuntimeState``, the runtime's counters and the only ways to change them from outside;
* ``program.py``: the stage-program protocol, a forward's result, log records, the loss read without a host sync;
* ``microbatch.py``: splitting a batch, loss weights and scales, merging outputs, each forward's random stream;
* ``whole_batch.py``: a loss computed once over each whole batch on the last stage, its gradient sent back per
  micro-batch;
* ``updates.py``: the checks made with an update in one host read, and when a deferred update is made;
* ``records.py``: bounded per-stage records and meters, read by the monitors;
* ``device_clock.py``: CUDA events around a stage's compute, read once per logging window;
* ``norm_table.py``: each stage's latest squared gradient norms, carried by the messages, for clipping;
* ``virtual_stages.py``: one device running several stages (chunks) in its own list's order;
* ``reference.py``: every stage's list run in one process, and the replicas' averages there.
"""

__all__: list[str] = []
