"""This process's stage of the pipeline and everything that runs it.

* ``local_stage.py``: ``LocalStage``: the carved module with its runtimes, driver, transport, replicas, log relay and
  evaluator, and the Lightning calls it answers;
* ``links.py``: ``StageLinks``, this process's connections, as its stage builds its transport from them;
* ``lightning_program.py``: one micro-batch of the user's unchanged step on a carved module, and Lightning's hooks
  at the stage's own backwards and updates;
* ``logs.py``: ``self.log`` recorded on the last stage, carried upstream, replayed on every rank;
* ``evaluation.py``: validation, test and predict as forward-only lists;
* ``setup_probe.py``: the sample micro-batch drawn at setup and what running the user's step on it teaches;
* ``reference_pipeline.py``: ``ReferencePipeline``, a module carved into all its stages in one process.
"""

__all__: list[str] = []
