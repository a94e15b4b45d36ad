"""The strategy's setup, around Lightning's own.

* ``stage_setup.py``: this process's stage built before Lightning's setup and started after it;
* ``trainer_checks.py``: what a pipeline refuses or warns about at setup;
* ``batch_coupling.py``: a loss that couples a batch's samples, found on rank 0 from the first batch;
* ``stage_build.py``: ``StageBuilder``: the model built on the meta device or whole, the plan, a stage made real;
* ``auto_plan.py``: ``plan="auto"``: measure, search, apply, and check the prediction against the run;
* ``tensor_parallel.py``: the user's ``configure_model`` (a tensor-parallel plan) run on the cut stage, with its
  mesh.
"""

__all__: list[str] = []
