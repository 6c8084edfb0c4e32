"""The sharding MIP's rows are written through pywraplp's low-level API for speed; each
must be the row that pywraplp's algebraic API (solver.Add(expression)) makes."""

import pytest
from ortools.linear_solver import linear_solver_pb2, pywraplp

from autopar.planner.ilp import _add_row


def _rows(solver) -> list[tuple]:
    """(name, lb, ub, {column: coefficient}) of every row, as the solver will see them."""
    model = linear_solver_pb2.MPModelProto()
    solver.ExportModelToProto(model)
    return [(c.name, c.lower_bound, c.upper_bound, dict(zip(c.var_index, c.coefficient))) for c in model.constraint]


def _pair():
    """Two solvers with the same four variables: one for each API."""
    out = []
    for _ in range(2):
        solver = pywraplp.Solver.CreateSolver("SCIP")
        out.append((solver, [solver.BoolVar(f"x{i}") for i in range(3)] + [solver.NumVar(0.0, 1.0, "y")]))
    return out


CASES = [  # name, (low-level: lb, ub, terms by variable number), algebraic form
    ("one_strategy", (1.0, 1.0, [(0, 1.0), (1, 1.0), (2, 1.0)]), lambda v: sum(v[:3]) == 1),
    ("reshard_out", (0.0, 0.0, [(3, 1.0), (0, -1.0), (2, -1.0)]), lambda v: sum([v[3]]) == v[0] + v[2]),
    ("reshard_from", (None, 0.0, [(3, 1.0), (1, -1.0)]), lambda v: v[3] <= sum([v[1]])),
    # a consumer that is also the producer: x0 on both sides cancels and leaves the row
    ("covered", (None, 0.0, [(0, 1.0), (1, 1.0), (0, -1.0), (3, -1.0)]), lambda v: v[0] + v[1] <= v[0] + v[3]),
    ("repeated", (None, 0.0, [(2, 1.0), (2, 1.0), (1, -1.0)]), lambda v: v[2] + v[2] <= v[1]),
]


@pytest.mark.parametrize("name,low,algebraic", CASES, ids=[c[0] for c in CASES])
def test_low_level_row_is_the_algebraic_row(name, low, algebraic):
    (fast, fv), (ref, rv) = _pair()
    lb, ub, terms = low
    _add_row(fast, -fast.infinity() if lb is None else lb, ub, name, [(fv[i], c) for i, c in terms])
    ref.Add(algebraic(rv), name)
    assert _rows(fast) == _rows(ref)
