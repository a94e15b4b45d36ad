"""A stage's optimizer: the user's optimizer stepped on the stage's own parameters, and the weight prediction.

* ``stage_optimizer.py``: ``StageOptimizer``, the user's optimizer stepped through alias parameters after every
  ``a`` local backwards ([Note: alias optimizer]), with its schedulers and the non-finite policy;
* ``weight_prediction.py``: staleness compensation, a forward that will cross ``k`` updates runs with the weights moved
  ``k`` predicted steps of the user's optimizer ahead, in a few multi-tensor passes or one fused pass per bin, and
  back to within one unit in the last place ([Note: weight prediction]);
* ``fused_prediction.py``: that move as one compiled (inductor) pass per bin of equal-length slices, the default on
  CUDA: one kernel per bin each way, 20 bytes read and written per parameter for AdamW ([Note: the fused prediction
  pass]);
* ``prediction_quality.py``: under ``compensation="auto"``, how much closer the moves bring a stage's forwards to the
  weights their backwards use, measured over its first updates, and the decision to keep or drop the prediction
  ([Note: the prediction's quality]);
* ``prediction_cost.py``: on CUDA under ``compensation="auto"``, the prediction kept only where it costs at most 10%
  of the stage's compute ([Note: the prediction's budget]).

Lightning-free (the engine imports both); one device's optimizer layout for checkpoints lives with the
checkpoints (:mod:`lightning_paci.integration.checkpoints.one_device_optimizer`).
"""

__all__: list[str] = []
