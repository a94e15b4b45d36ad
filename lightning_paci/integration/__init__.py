"""The Lightning integration: an unchanged LightningModule and a Trainer, delegated to the engine.

The folders, each importing only the ones listed after it:

* ``setup/``: the strategy's setup: the Trainer's checks, the model's construction, the plan, the stage built;
* ``stage/``: ``LocalStage``, this process's stage and everything that runs it; the setup's sample step;
  ``ReferencePipeline``;
* ``processes/``: the process side: the groups, the launcher, how a run ends on every rank;
* ``checkpoints/``: the checkpoint format, the strategy's checkpoint hooks, one device's optimizer;
* ``lightning_callbacks/``: Lightning's own callbacks on each stage;
* ``trainer/``: the fit loop's data and patches, clipping, Lightning's private API, what the parts read from the
  strategy.

The strategy (``lightning_paci/strategy.py``) wires these to Lightning's hooks.
"""

__all__: list[str] = []
