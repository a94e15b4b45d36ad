"""How stages talk: messages, their wire format, links, process groups and collectives.

* ``messages.py``: a message's structure (a skeleton of tensor metadata and the tensors);
* ``wire.py``: the header of a one-buffer message and its reuse on each link;
* ``split_wire.py``: under NCCL, headers on a host side channel and payloads on the device;
* ``point_to_point.py``: ``DistComm``, point-to-point messages over process groups, receives posted ahead;
* ``receives_ahead.py``: which receive each link posts next while a stage runs its actions, and under NCCL the
  thread that waits for a link's posted headers;
* ``local_mailbox.py``: ``LocalComm``, the same interface in one process (reference executor, sibling chunks);
* ``groups.py``: every process group of the setup, created and connected in one order;
* ``collectives.py``: object broadcasts and gathers over the host group, reductions over a stage's replicas;
* ``pickle_guard.py``: no tensor through pickle;
* ``nccl_emulation.py``: NCCL's rules enforced over gloo, so the CPU runs the GPU code path.
"""

__all__: list[str] = []
