"""Data parallelism per stage: where each replica runs, and what the replicas of a stage share.

* ``topology.py``: stages x replicas over the ranks, checked at construction;
* ``data_parallel.py``: the replicas' gradient (or LocalSGD parameter) averages before each local step;
* ``grad_buckets.py``: that average in buckets, started while the window's last backward still runs;
* ``optimizer_shards.py``: the optimizer state sharded over the replicas (ZeRO stage 1).
"""

__all__: list[str] = []
