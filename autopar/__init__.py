"""autopar: an auto-parallelism compiler for PyTorch training.

    import autopar
    report = autopar.analyze(model, example_inputs, cluster="2x8xH100", loss_fn=...)
    print(report.table())
"""

from autopar.analysis import analyze
from autopar.api import plan
from autopar.parallel import ParallelModule, parallelize
from autopar.plan import Plan
from autopar.cluster import Cluster, parse_cluster
from autopar.errors import AutoparError, ClusterSpecError, InfeasibleError, PlanError, TraceError

__version__ = "0.1.0"

__all__ = ["analyze", "plan", "Plan", "parallelize", "ParallelModule", "Cluster", "parse_cluster", "AutoparError", "ClusterSpecError",
           "InfeasibleError", "PlanError", "TraceError", "__version__"]
