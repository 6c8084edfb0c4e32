"""Parameters the loss does not reach (an unused layer; a routing bias read only under
``torch.no_grad``, as DeepSeek-V3.2's indexer and AFMoE's expert bias are): eager PyTorch
leaves their ``.grad`` None and AdamW skips them. autopar's joint graph has no gradient for
them (AOTAutograd returns None), and the step program used to fail on it (``'NoneType' object
has no attribute 'placements'``). Now they are held like frozen parameters: on 2 gloo ranks
under dp=2 and tp=2 the model trains as in one process, and they do not move.
"""

import pytest
import torch
from torch import nn

from autopar.testing import spawn_world, tp_friendly_cluster
from parallel_compare import Reference, assert_matches, train_judged

CONFIGS = [("dp", "1x2xcpu", {"dp": 2, "tp": 1}), ("tp", tp_friendly_cluster("1x2xcpu"), {"tp": 2})]
UNREACHED = ("unused.weight", "unused.bias", "route_bias")


class Model(nn.Module):
    def __init__(self, d=32, vocab=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab)
        self.unused = nn.Linear(d, d)  # never called
        self.route_bias = nn.Parameter(torch.randn(d))  # read without gradient

    def forward(self, ids, labels):
        x = self.embed(ids)
        with torch.no_grad():
            scale = torch.sigmoid(self.route_bias)  # (d,)
        x = x + self.down(torch.relu(self.up(x))) * scale
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


def _train(rank, world, configs):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (8, 16), generator=g)
    inputs = {"ids": ids, "labels": ids.roll(1, dims=1)}
    report = {}
    for name, cluster, fixed in configs:
        torch.manual_seed(0)
        model = Model()
        before = {k: model.state_dict()[k].clone() for k in UNREACHED}
        import autopar

        reference = Reference(model, _optimizer) if rank == 0 else None
        pm = autopar.parallelize(model, cluster=cluster, fixed=fixed, optimizer=_optimizer)
        raw, losses, grad_err, param_err = train_judged(
            pm, reference, steps=3, run=lambda pm: pm.train_step(inputs),
            run_reference=lambda ref, like: ref(**like(inputs)))
        state = pm.state_dict()
        report[name] = {"raw": raw, "losses": losses, "grad_err": grad_err, "param_err": param_err,
                        "mesh": pm.plan.mesh, "moved": [k for k in UNREACHED if not torch.equal(state[k], before[k])],
                        "graded": sorted(set(pm.full_gradients()) & set(UNREACHED))}
    return report


@pytest.fixture(scope="module")
def results():
    return spawn_world(_train, 2, CONFIGS)


@pytest.mark.parametrize("config", [c[0] for c in CONFIGS])
def test_trains_as_one_process_and_unreached_parameters_stay(results, config):
    judged = results[0][config]
    assert_matches(judged["losses"], judged["grad_err"], judged["param_err"], config)
    assert set(judged["grad_err"]) == {"embed.weight", "up.weight", "up.bias", "down.weight", "down.bias",
                                       "head.weight", "head.bias"}
    for rank_result in results:
        r = rank_result[config]
        assert r["mesh"][config] == 2 and r["raw"] == judged["raw"]
        assert r["moved"] == [] and r["graded"] == []
