"""The comparison the multi-process tests use (``parallel_compare``), checked in one process:
it accepts what summing in another order does, in fp32, and rejects what an engine bug does
(a gradient off by 0.1%, a dropped micro-batch), for plain sums and for AdamW training."""

import copy

import pytest
import torch

from parallel_compare import FACTOR, Reference, assert_matches, errors, gap, train_alongside


def _terms(n=512, width=64, cancel=True):
    """(n, width) fp32 terms; with ``cancel`` each column sums to ~1/20 of its absolute sum."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(n, width, generator=g, dtype=torch.float64)
    if cancel:
        t = t - t.mean(0) + torch.randn(width, generator=g, dtype=torch.float64) / n ** 0.5 / 20 * t.abs().mean(0)
    return t.float()


def test_summation_order_noise_passes():
    t = _terms()
    truth, one = t.double().sum(0), t.sum(0)
    two = t[::2].sum(0) + t[1::2].sum(0)  # as dp: each rank sums half, then the halves are added
    g = gap(two, one, truth)
    assert g.ok, g.describe()
    assert g.err > 0 and g.noise > 0  # real rounding on both sides, not a trivially exact case


def test_zero_in_exact_arithmetic_is_judged_against_the_noise():
    a = _terms(256, cancel=False)
    t = torch.cat([a, -a])[torch.randperm(512, generator=torch.Generator().manual_seed(1))]
    # each column sums to 0 in exact arithmetic (as a key-bias gradient); fp32 leaves a residue
    truth, one, two = t.double().sum(0), t.sum(0), t[::2].sum(0) + t[1::2].sum(0)
    assert float(truth.norm()) < 1e-12 * float(t.norm())
    assert gap(two, one, truth).ok
    assert not gap(two + 1e-3 * t.abs().sum(0) / t.shape[0], one, truth).ok  # residue 1e-3 of a term


@pytest.mark.parametrize("bug", ["scaled by 1.001", "dropped half"])
def test_engine_bugs_fail(bug):
    t = _terms()
    truth, one = t.double().sum(0), t.sum(0)
    got = one * 1.001 if bug == "scaled by 1.001" else 2 * t[::2].sum(0)
    g = gap(got, one, truth)
    assert not g.ok
    assert g.err > 100 * g.bound or bug == "scaled by 1.001"  # a 1e-3 error is ~8000 ulps; the bound a few hundred
    assert g.err > 2 * g.bound


class _Accumulating:
    """Stands in for a ParallelModule: the model in fp32, each step's batch in two
    micro-batches (as dp=2 sums), with an optional engine bug."""

    def __init__(self, model, optimizer, bug=None):
        self.model, self.bug = copy.deepcopy(model), bug
        self.opt = optimizer(self.model.parameters())

    def train_step(self, x, y):
        self.opt.zero_grad()
        halves = [(x[:len(x) // 2], y[:len(y) // 2]), (x[len(x) // 2:], y[len(y) // 2:])]
        if self.bug == "dropped micro-batch":
            halves = halves[:1] * 2
        total = 0.0
        for xb, yb in halves:
            loss = torch.nn.functional.cross_entropy(self.model(xb), yb) / 2
            loss.backward()
            total += loss.item()
        if self.bug == "gradient scaled by 1.001":
            self.model[0].weight.grad *= 1.001
        self.opt.step()
        return total

    def full_gradients(self):
        return {k: p.grad for k, p in self.model.named_parameters()}

    def state_dict(self):
        return {k: p.detach() for k, p in self.model.named_parameters()}


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


def _train(bug, runner=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    x, y = torch.randn(256, 32), torch.randint(0, 16, (256,))
    reference = Reference(model, _adamw)
    pm = (runner or _Accumulating)(model, _adamw, bug)
    losses = train_alongside(pm, reference, steps=3, run=lambda pm: pm.train_step(x, y),
                             run_reference=lambda ref, like: torch.nn.functional.cross_entropy(ref(like(x)), y))
    return losses, *errors(pm, reference)


def test_adamw_training_in_micro_batches_passes():
    losses, grads, params = _train(None)
    assert_matches(losses, grads, params, "micro-batches")
    assert all(g.err > 0 for g in grads.values())  # they did sum in another order


@pytest.mark.parametrize("bug,fails", [("gradient scaled by 1.001", "gradient of 0.weight"),
                                       ("dropped micro-batch", "loss of step 0")])
def test_adamw_training_with_an_engine_bug_fails(bug, fails):
    with pytest.raises(AssertionError, match=fails):
        assert_matches(*_train(bug), bug)


def test_adam_allowance_is_what_the_optimizer_makes_of_the_parallel_gradients():
    """With SGD the shadow parameters differ from the fp64 ones by lr * (the parallel gradients'
    errors, summed over the steps); without them, by lr * FACTOR * (the fp32 noise, summed)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    x, y = torch.randn(64, 8), torch.randn(64, 4)
    loss_of = lambda m, like: ((m(like(x)) - like(y)) ** 2).mean()  # noqa: E731
    for given in (True, False):
        reference = Reference(model, lambda p: torch.optim.SGD(p, lr=0.1))
        expected = {}
        for step in range(2):
            grads = None
            if given:  # the "parallel" gradients: the fp32 ones, perturbed
                m = copy.deepcopy(reference.fp32)
                loss_of(m, lambda t: t).backward()
                grads = {k: p.grad * (1 + 1e-4 * (step + 1)) for k, p in m.named_parameters()}
            reference.step(loss_of, grads)
            for k, p in reference.fp64.named_parameters():
                g32 = reference.fp32.get_parameter(k).grad.double()
                got = grads[k].double() if given else p.grad + FACTOR * (g32 - p.grad)
                expected[k] = expected.get(k, 0) + (got - p.grad)
        _, params = reference.gaps({k: p.grad for k, p in reference.fp32.named_parameters()},
                                   {k: p.detach() for k, p in reference.fp32.named_parameters()})
        for k, g in params.items():
            assert g.adam == pytest.approx(0.1 * float(expected[k].norm()), rel=1e-6), (given, k)


class _WrongOptimizer(_Accumulating):
    """Right gradients, a wrong optimizer step: the learning rate 1% off, or one entry left out."""

    def __init__(self, model, optimizer, bug):
        super().__init__(model, optimizer)
        self.optimizer_bug = bug

    def train_step(self, x, y):
        before = self.model[0].weight.detach().clone()
        for group in self.opt.param_groups:
            group["lr"] = 1e-2 * (1.01 if self.optimizer_bug == "lr 1% off" else 1.0)
        total = super().train_step(x, y)
        if self.optimizer_bug == "one entry not stepped":
            with torch.no_grad():
                self.model[0].weight[3, 5] = before[3, 5]
        return total


@pytest.mark.parametrize("bug", ["lr 1% off", "one entry not stepped"])
def test_an_optimizer_bug_fails_on_the_parameters(bug):
    """The allowance covers what the optimizer makes of the run's own gradients, not a wrong step."""
    _, _, params = _train(bug, _WrongOptimizer)  # (later gradients differ as well: they see the wrong parameters)
    with pytest.raises(AssertionError, match="parameter"):
        assert_matches([], {}, params, bug)
    g = params["0.weight"]
    assert g.err > 3 * g.bound, g.describe()  # (measured: 5.6x for the learning rate, 20x for the entry)
