"""Lightning's own callbacks under a pipeline, each acting on the stage's own part.

* ``per_stage.py``: the strategy's one setup hook for the callbacks below;
* ``batch_outputs.py``: what ``on_train_batch_end`` hands callbacks, and the settings a stage cannot run, refused;
* ``weight_averaging.py``: ``WeightAveraging`` (``EMAWeightAveraging``) per stage;
* ``stochastic_weight_averaging.py``: ``StochasticWeightAveraging`` per stage;
* ``finetuning.py``: ``BaseFinetuning`` and its subclasses per stage;
* ``pruning.py``: ``ModelPruning`` per stage, a global amount ranked over every stage.
"""

__all__: list[str] = []
