"""The Trainer's side: the fit loop, clipping, Lightning's private API, and the strategy as its parts see it.

* ``fit_loop.py``: the same batches on every stage, the drain points, the fit loop's patches;
* ``clipping.py``: ``gradient_clip_val`` by the norm over every stage's gradients;
* ``fingerprint.py``: every stage checks that it trained on stage 0's batches;
* ``lightning_api.py``: every private Lightning symbol, checked at import or before patching;
* ``pipeline_strategy.py``: ``PipelineStrategy``, what the integration's parts read from the strategy.
"""

__all__: list[str] = []
