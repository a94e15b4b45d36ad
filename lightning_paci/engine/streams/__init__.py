"""Lightning calls turned into a stage's actions: streams of batches between two drains.

* ``cursor.py``: which actions of its list a stage runs in each call of a stream, without rebuilding the list;
* ``driver.py``: ``StreamDriver``, feeding each Lightning batch into the runtime, the drains, the updates each
  forward crosses.
"""

__all__: list[str] = []
