"""autopar: an auto-parallelism compiler for PyTorch training.

    import autopar
    report = autopar.analyze(model, example_inputs, cluster="2x8xH100", loss_fn=...)
    print(report.table())

The names below load on first use (PEP 562), so ``import autopar.plan_diff``
(``autopar diff``) and the pytest plugin do not pay for importing torch.
"""

import importlib

# `autopar.plan` names both a module and the planning function; importing the module now
# keeps a later `import autopar.plan` from rebinding the attribute to the module.
import autopar.plan as _plan_module  # noqa: F401
from autopar.errors import (AutoparError, CheckpointError, ClusterSpecError, InfeasibleError, InputError, LossError, OutputPathError,
                            PeerError, PlanError, TraceError, UserCodeError)

__version__ = "0.1.0"

_LAZY = {
    "analyze": "autopar.analysis",
    "plan": "autopar.api",
    "Plan": "autopar.plan",
    "parallelize": "autopar.parallel",
    "ParallelModule": "autopar.parallel",
    "Cluster": "autopar.cluster",
    "parse_cluster": "autopar.cluster",
    "materialize": "autopar.runtime.materialize",
}

del plan  # the submodule bound by the import above; `autopar.plan` is the function (see __getattr__)

__all__ = ["analyze", "plan", "Plan", "parallelize", "ParallelModule", "Cluster", "parse_cluster", "materialize", "AutoparError", "CheckpointError", "ClusterSpecError",
           "InfeasibleError", "InputError", "LossError", "OutputPathError", "PeerError", "PlanError", "TraceError",
           "UserCodeError", "__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
