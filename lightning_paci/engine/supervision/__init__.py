"""No stage waits forever for a dead one: the failure watchdog and what it knows.

* ``watchdog.py``: heartbeats, failure reports and the end of every run through the rendezvous store;
* ``activity.py``: what this process's main thread is doing and whom it waits for, as the watchdog publishes it;
* ``lost_peers.py``: who is gone when a connection is lost;
* ``preemption.py``: the batch every process stops before on a SIGTERM, agreed through the store.
"""

__all__: list[str] = []
