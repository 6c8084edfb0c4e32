"""Shared by the multi-process tests: train a ParallelModule beside the same model in one
process and judge whether the parallel run is as accurate as that one process.

The tolerance scheme (README, "Testing")
----------------------------------------
A parallel fp32 run cannot match a one-process fp32 run bit for bit: it sums in another
order (a tp all-reduce adds partial matmul results, dp averages per-rank gradients), and
fp32 addition is not associative. How far apart two correct fp32 runs land depends on the
quantity: a gradient that is a sum with much cancellation (T5's cross-attention q/k
weights: 512 terms per entry whose absolute values add up to 13-26x the result) is only
good to ~55 ulps in fp32, a LayerNorm weight to a few. A fixed relative tolerance is too
loose for the second and, for the first, passes or fails by luck of summation order.

So the single-process reference is trained twice, in fp32 and in fp64 (``Reference``),
and the fp64 run stands in for exact arithmetic (its rounding is 2**29 times smaller).
For each compared quantity x (a step's loss, a gradient tensor, a parameter tensor)::

    err   = |x_parallel - x_fp64|        how far the parallel run is from the truth
    noise = |x_fp32 - x_fp64|            how far one fp32 process is: this quantity's rounding noise
    pass iff  err <= FACTOR * noise + FLOOR_ULPS * EPS32 * |x_fp64|  (+ ADAM, parameters only)

(norms over each tensor). That says "the parallel run is as accurate as one process",
whatever the conditioning of x. A value that is zero in exact arithmetic (the gradient of
an attention key bias: softmax ignores a shift shared by all keys) is judged against the
noise fp32 makes summing terms of its size, which ``noise`` measures, not by relative error.

- FACTOR = 4: the parallel error is a second draw of the same kind of rounding (different
  order, one more addition of partial results). Measured over the 12 Hugging Face configs
  of test_hf_models.py, err / noise is 0.5-2.1 for gradients (BERT under dp, whose
  per-rank masked-token means are averaged, is the 2.1); a norm over >= 10 entries
  concentrates, so 4 leaves a factor 2 beyond the worst seen.
- FLOOR_ULPS = 8: the reference may by chance round a result almost exactly (a
  one-element-like tensor, a loss); any fp32 result carries half an ulp from being stored
  and the parallel one a few more roundings (the cross-rank sum, the division by the
  world size). A loss, the mean of B*T positive terms, is good to log2(B*T) = 9 ulps with
  pairwise summation; we see <= 1.6.
- ADAM (parameters after steps): AdamW's update m/(sqrt(v) + eps) is normalised, so a
  gradient entry near zero turns noise into a parameter change of up to lr * noise / eps per
  step (bounded by ~lr: |m/sqrt(v)| <= 1 for the first steps), and which entries sit near
  zero, and where each run's rounding lands, is luck. So parameters also get what the
  optimizer itself makes of the gradients the parallel run really had: a shadow copy of the
  fp64 parameters is stepped by the same optimizer on the parallel run's (gathered) gradients
  every step, and |shadow - x_fp64| is added to the bound. The parallel parameters are the
  shadow's plus the fp32 rounding of the optimizer's arithmetic (within the fp32 process's own
  noise): a correct optimizer step passes whatever its gradients' rounding was, a wrong one
  (learning rate, a skipped entry or shard) misses by ~lr. Where the parallel gradients of a
  step are not at hand (a step the reference takes alone, as the checkpoint tests do for the
  side another world trained) the shadow steps on ``g_fp64 + FACTOR * (g_fp32 - g_fp64)``, a
  model of them. (Before this, every step used that model; on an AMD EPYC host GPT under cp=2
  put 10x the fp32 process's error on one LayerNorm-bias entry whose step-3 gradient was 2e-5,
  while the tensor's gradient was within 2.3x its noise: the model said 4x, at that entry.)
  With SGD the allowance is lr * |g_parallel - g_fp64| summed over the steps. (eps = 1e-5 in
  the tests keeps the sensitivity, 1/eps, finite-sized: with the default 1e-8 a single entry
  could move by a whole lr.) Adam is scale-invariant, so a gradient that is wrong by a
  constant factor leaves the parameters nearly unchanged: the gradient comparison, not the
  parameter one, is what catches such a bug; tests/dist/test_parallel_compare.py checks that
  an optimizer bug fails the parameter comparison.

A real engine error (a gradient scaled by 1.001, a dropped micro-batch) is ~8000 ulps or
more: tests/dist/test_parallel_compare.py checks that the criterion rejects it and accepts
summation-order noise. Measured on 2 gloo ranks (the Llama example, dp=2, 3 steps): the
correct run uses at most 0.22 of any gradient's bound and 0.11 of any parameter's; one
gradient scaled by 1.001 is 62x outside its bound; a micro-batch fed twice instead of
another is 600x (the first loss) to 10^5x (gradients) outside.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

EPS32 = torch.finfo(torch.float32).eps  # 2**-23: one ulp of 1.0 in fp32
FACTOR = 4.0
FLOOR_ULPS = 8.0


@dataclass(frozen=True)
class Gap:
    """One compared quantity: distances (norms) of the parallel and the fp32 one-process
    results from the fp64 truth, the truth's size, and any optimizer allowance."""

    err: float
    noise: float
    scale: float
    adam: float = 0.0

    @property
    def bound(self) -> float:
        return FACTOR * self.noise + FLOOR_ULPS * EPS32 * self.scale + self.adam

    @property
    def ok(self) -> bool:
        return math.isfinite(self.err) and self.err <= self.bound

    def describe(self) -> str:
        s = max(self.scale, 1e-300)
        return (f"{self.err / s:.2e} of its size from the fp64 run, allowed {self.bound / s:.2e} "
                f"(one fp32 process: {self.noise / s:.2e}; err/noise = {self.err / max(self.noise, 1e-300):.1f})")


def gap(got: torch.Tensor | float, fp32: torch.Tensor | float, fp64: torch.Tensor | float, adam: float = 0.0) -> Gap:
    got, fp32, fp64 = (torch.as_tensor(x, dtype=torch.float64) for x in (got, fp32, fp64))
    return Gap(err=float((got - fp64).norm()), noise=float((fp32 - fp64).norm()), scale=float(fp64.norm()), adam=adam)


def float64_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in fp64. Hugging Face's grouped-matmul experts (Mixtral) have no
    fp64 kernel on CPU: the twin uses transformers' per-expert loop, the same arithmetic."""
    twin = copy.deepcopy(model).double()
    for module in twin.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"
    return twin


def as_dtype(tree, dtype: torch.dtype):
    """``tree`` (tensors in tuples, lists, dicts) with floating tensors cast to ``dtype``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(as_dtype(x, dtype) for x in tree)
    if isinstance(tree, dict):
        return {k: as_dtype(v, dtype) for k, v in tree.items()}
    return tree


class Reference:
    """The model trained in one process in fp32 (as the parallel run) and in fp64 (the
    truth), each with its own ``optimizer(params)``, plus the shadow parameters that give
    the optimizer allowance (module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer):
        self.fp32 = copy.deepcopy(model)
        self.fp64 = float64_twin(model)
        self._opt32, self._opt64 = optimizer(self.fp32.parameters()), optimizer(self.fp64.parameters())
        self._reset_shadow(optimizer)
        self._optimizer = optimizer

    def _reset_shadow(self, optimizer) -> None:
        self._shadow = {k: p.detach().clone() for k, p in self.fp64.named_parameters()}
        self._shadow_opt = optimizer(list(self._shadow.values()))

    def step(self, loss_of, grads: dict[str, torch.Tensor] | None = None) -> tuple[float, float]:
        """One optimizer step of both models on ``loss_of(model, like)``, where ``like(x)``
        casts the floating tensors of ``x`` to the model's dtype; their (fp32, fp64) losses.
        ``grads``: the parallel run's whole gradients of this step, by parameter name, which
        the shadow steps on (module docstring); without them (or for a name missing there) the
        shadow steps on the model of them."""
        losses = []
        for model, opt, dtype in ((self.fp32, self._opt32, torch.float32), (self.fp64, self._opt64, torch.float64)):
            opt.zero_grad()
            loss = loss_of(model, lambda x, dtype=dtype: as_dtype(x, dtype))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        p32 = dict(self.fp32.named_parameters())
        for k, p64 in self.fp64.named_parameters():
            if p64.grad is None:  # the loss does not reach it: no step (AdamW skips it), here as in the run
                self._shadow[k].grad = None
                continue
            g64, g32 = p64.grad, p32[k].grad.double()
            got = (grads or {}).get(k)
            self._shadow[k].grad = got.detach().double() if got is not None else g64 + FACTOR * (g32 - g64)
        self._shadow_opt.step()
        return losses[0], losses[1]

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restart both from ``state`` (the optimizers keep theirs; stateless ones are exact)."""
        self.fp32.load_state_dict(state)
        self.fp64.load_state_dict(state)  # (copied into the fp64 parameters: cast)
        self._reset_shadow(self._optimizer)

    def gaps(self, grads: dict[str, torch.Tensor], state: dict[str, torch.Tensor], skip=()) -> tuple[dict, dict]:
        """Per parameter name, the ``Gap`` of the parallel run's last gradient and parameter."""
        p32, p64 = dict(self.fp32.named_parameters()), dict(self.fp64.named_parameters())
        names = [k for k in grads if k not in skip]
        g = {k: gap(grads[k], p32[k].grad, p64[k].grad) for k in names}
        p = {k: gap(state[k], p32[k].detach(), p64[k].detach(),
                    adam=float((self._shadow[k] - p64[k].detach()).norm())) for k in names}
        return g, p


def train_alongside(pm, reference: Reference, *, steps: int, run, run_reference) -> list[Gap]:
    """``steps`` steps of both; the ``Gap`` of each step's loss.

    ``run(pm)`` makes one ``train_step`` and returns its loss; ``run_reference(model, like)``
    returns the reference's loss tensor on the same global batch, its floating inputs passed
    through ``like`` (the fp64 twin needs fp64 pixels).
    """
    losses = []
    for _ in range(steps):
        loss = run(pm)
        l32, l64 = reference.step(run_reference, pm.full_gradients())  # (a collective: every rank calls it)
        losses.append(gap(loss, l32, l64))
    return losses


def train_judged(pm, reference: Reference | None, *, steps: int, run, run_reference, skip=()):
    """Train ``pm`` ``steps`` steps and judge it on one rank of the world.

    The one-process references are the same on every rank, so one rank trains them (a world of
    4 ranks trained them 4 times, a few CPU-s each): with ``reference`` (that rank) this returns
    (raw losses, loss ``Gap`` per step, gradient gaps, parameter gaps) as :func:`train_alongside`
    and :func:`errors`; without (the others) (raw losses, None, None, None), after the same steps
    and the same collectives (every rank joins the gathers of the whole gradients and parameters).
    Callers check every rank's raw losses equal the judged rank's: each rank's step returns the
    loss all ranks agreed on."""
    raw = []

    def step(pm):
        raw.append(float(run(pm)))
        return raw[-1]

    if reference is None:
        for _ in range(steps):
            step(pm)
            pm.full_gradients()  # (the gather train_alongside makes every step)
        pm.full_gradients(), pm.state_dict()  # (the collectives errors() joins, in its order)
        return raw, None, None, None
    losses = train_alongside(pm, reference, steps=steps, run=step, run_reference=run_reference)
    grad_gaps, param_gaps = errors(pm, reference, skip)
    return raw, losses, grad_gaps, param_gaps


def errors(pm, reference: Reference, skip=()) -> tuple[dict[str, Gap], dict[str, Gap]]:
    """The ``Gap`` of the last gradients and of the parameters, per parameter name
    (collectives: every rank calls this)."""
    return reference.gaps(pm.full_gradients(), pm.state_dict(), skip)


def assert_matches(losses: list[Gap], grad_gaps: dict[str, Gap], param_gaps: dict[str, Gap], where: str) -> None:
    for step, g in enumerate(losses):
        assert g.ok, f"{where}: loss of step {step} is {g.describe()}"
    for kind, gaps in (("gradient", grad_gaps), ("parameter", param_gaps)):
        bad = {k: g for k, g in gaps.items() if not g.ok}
        if bad:
            worst = max(bad, key=lambda k: bad[k].err / max(bad[k].bound, 1e-300))
            raise AssertionError(f"{where}: {len(bad)} {kind}s outside the tolerance, e.g. {kind} of "
                                 f"{worst} is {bad[worst].describe()}")
