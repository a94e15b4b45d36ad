"""``plan="auto"``: the plan chosen for the user from measured costs, the simulator and a memory budget.

* ``costs.py``: the profiling pass -- each block's forward and backward time and the activation bytes a
  micro-batch keeps alive, at two micro-batch sizes ([Note: the plan's measurements]);
* ``search.py``: every plan of the space predicted on the simulator, the fastest under the budget and the drift
  limit first ([Note: the plan search]);
* ``table.py``: the table of the choice and its runners-up, the options that pin it, the check against the run.
"""

from lightning_paci.planner.costs import Fit, ModelCosts, Region, measure_costs
from lightning_paci.planner.search import Layout, Link, Plan, Space, search_plans, simulate_plan

__all__ = ["Fit", "Layout", "Link", "ModelCosts", "Plan", "Region", "Space", "measure_costs", "search_plans",
           "simulate_plan"]
