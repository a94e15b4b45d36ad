"""The process side of a pipeline under Lightning: from the launch to the end of every rank's run.

* ``process_life.py``: ``ProcessLife``, the strategy's process hooks: the launcher, joining, the heap freeze, the
  failure report, the end of a run;
* ``process_groups.py``: the rendezvous store, the watchdog, the world and every group (``ProcessGroups``);
* ``host_interface.py``: the network interface the host group's gloo connects over across nodes;
* ``shutdown.py``: how a run ends on every rank: together when it succeeds, one line per rank when one fails.
"""

__all__: list[str] = []
