"""A stage's own blocks run another way than eagerly, each switched on by an option.

* ``block_compile.py``: each block's ``forward`` through ``torch.compile`` (``compile="blocks"``);
* ``recompute.py``: a block keeps only its inputs between forward and backward (``recompute="blocks"``);
* ``layered.py``: the layer-major backward of ``schedule="layered"``.
"""

__all__: list[str] = []
