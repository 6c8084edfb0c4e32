"""Every Hugging Face model of examples/hf.py (tiny configs) is planned for one and
for four 8xH100 nodes: a valid plan that covers the whole model, with its FLOPs.

Each model is traced once (batch 8 and 16, sequence 16) and both clusters are
planned from those graphs (same device, so the same cost annotations).
"""

import sys
from pathlib import Path

import pytest

from autopar.cluster import parse_cluster
from autopar.passes import meta_keys as mk
from autopar.plan import Plan
from autopar.planner.frontend import trace_pair
from autopar.planner.make import plan_graphs
from autopar.planner.search import Fixed

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hf  # noqa: E402

CLUSTERS = ("1x8xH100", "4x8xH100")


@pytest.fixture(scope="module", params=list(hf.MODELS))
def planned(request):
    model, inputs, _, _ = hf.build(model=request.param, batch=8, seq=16)
    gm, gm2 = trace_pair(model, inputs, cluster=parse_cluster(CLUSTERS[0]), loss_fn=None, example_target=None)
    plans = {c: plan_graphs(gm, gm2, cluster=parse_cluster(c), fixed=Fixed.from_dict(None)) for c in CLUSTERS}
    return model, gm, plans


@pytest.mark.parametrize("spec", CLUSTERS)
def test_plan_is_valid_and_covers_the_model(planned, spec):
    model, gm, plans = planned
    plan, cluster = plans[spec], parse_cluster(spec)
    plan.validate(world_size=cluster.world_size)
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    assert plan.model["name"] == type(model).__name__
    assert plan.cluster["spec"] == spec

    # every parameter (and buffer) has a placement on tp, every op of the graph a strategy
    placed = {fqn: p for layer in plan.layers.values() for fqn, p in layer["params"].items()}
    assert set(gm.meta[mk.GRAPH].param_fqns) <= set(placed)
    ops = [n.name for n in gm.graph.nodes if n.op == "call_function" and "getitem" not in n.name]
    assert set(ops) <= set(plan.ops), sorted(set(ops) - set(plan.ops))[:5]

    # the stages hold every layer instance exactly once
    staged = [p for stage in plan.stages for p in stage["layers"]]
    assert len(staged) == len(set(staged)) == sum(layer["count"] for layer in plan.layers.values())

    # matmul FLOPs are counted (attention, MLP or experts, head) and the step takes time
    assert plan.predicted["model_flops_per_step"] > 0
    assert plan.predicted["step_time_s"] > 0
    assert plan.predicted["peak_memory_bytes"] < cluster.device.hbm_bytes
