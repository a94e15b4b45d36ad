"""The Lightning integration: an unchanged LightningModule and a Trainer, delegated to the engine.

* ``local_stage.py``: ``LocalStage``, this process's stage: the carved module with its runtime, driver,
  communicators, replicas, log relay and evaluator;
* ``lightning_program.py``: one micro-batch of the user's unchanged step on a carved module (the engine's
  ``StageProgram``), and Lightning's backward/optimizer hooks at the stage's own backwards and updates;
* ``processes.py``: the process groups, the device mesh, point-to-point communicators, the watchdog, collectives;
* ``shutdown.py``: how a run ends on every rank, the teardown still watched, a failure reported once;
* ``auto_plan.py``: ``plan="auto"`` at setup, and the check of its prediction against the run;
* ``stage_build.py``, ``setup_probe.py``: the model's construction and partition plan; the setup's sample step;
* ``trainer_checks.py``: what a pipeline refuses or warns about at setup;
* ``fit_loop.py``: the same batches on every stage, the drain points, the fit loop's two patches;
* ``lightning_api.py``: every private Lightning symbol, checked at import or before patching;
* ``logs.py``: ``self.log`` recorded on the last stage and replayed on every rank;
* ``evaluation.py``: validation, test and predict as forward-only lists;
* ``checkpoint.py``, ``optimizer_layout.py``: the checkpoint format and what is kept after ``fit``, one device's
  optimizer layout;
* ``fingerprint.py``: every stage checks it trained on stage 0's batches;
* ``reference_pipeline.py``: ``ReferencePipeline``, a module carved into all its stages in one process.

The strategy (``lightning_paci/strategy.py``) wires these to Lightning's hooks.
"""

__all__: list[str] = []
