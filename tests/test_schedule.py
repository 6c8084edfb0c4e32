"""Pipeline schedules: generators, validation, send/recv lowering and the simulator.

Textbook checks with T_F = T_B = T_W = 1 (fused BW = 2): 1F1B and GPipe bubble
(p - 1) / (m + p - 1), interleaved (p - 1) / (v m + p - 1), ZB-H1 (p - 1) / (3m + p - 1).
"""

import ast
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cost.schedule import (
    SCHEDULE_KINDS,
    Action,
    format_grid,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    parse_action,
    validate_schedule,
    with_comm,
    zb_h1,
    zb_h2,
)
from autopar.cost.simulate import simulate


def unit_sim(schedule, n_stages, *, w=1.0, **kw):
    return simulate(schedule, f_s=[1.0] * n_stages, b_s=[1.0] * n_stages, w_s=[w] * n_stages, **kw)


def hand(lists):
    return {rank: [parse_action(a) for a in acts.split()] for rank, acts in enumerate(lists)}


# ---------------------------------------------------------------- actions


def test_action_str_parse_roundtrip():
    for a in (Action(0, "F", 3), Action(1, "B", 0), Action(0, "W", 2), Action(12, "BW", 10)):
        assert parse_action(str(a)) == a
    assert str(Action(0, "F", 3)) == "0F3" and str(Action(1, "BW", 0)) == "1BW0"
    with pytest.raises(ValueError, match="kind"):
        Action(0, "X", 0)
    with pytest.raises(ValueError, match="cannot parse"):
        parse_action("F3")


def test_cost_modules_import_no_torch():
    # the step program reads the one ZeRO definition (plain data, no torch), as cost/memory.py does
    allowed = {"__future__", "collections", "collections.abc", "dataclasses", "functools", "heapq", "math", "autopar.cost", "autopar.cost.comm", "autopar.cost.devices",
               "autopar.cost.schedule", "autopar.cost.step", "autopar.zero_def"}
    for name in ("schedule.py", "simulate.py", "step.py"):
        tree = ast.parse((Path(__file__).parents[1] / "autopar" / "cost" / name).read_text())
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert mods <= allowed, (name, mods)


# ---------------------------------------------------------------- bubbles (textbook)


@pytest.mark.parametrize("p, m", [(4, 8), (2, 4), (8, 8), (3, 5), (1, 4), (4, 2)])
def test_1f1b_and_gpipe_bubble_closed_form(p, m):
    for sched in (one_f_one_b(p, m), gpipe(p, m)):
        r = unit_sim(sched, p)
        assert r.bubble_fraction == (p - 1) / (m + p - 1)
        assert r.step_time_s == 3 * (m + p - 1)
        assert r.busy_s == (3.0 * m,) * p


@pytest.mark.parametrize("p, m", [(4, 8), (2, 4), (8, 8), (3, 5)])
def test_peak_inflight_gpipe_m_vs_1f1b_p_minus_s(p, m):
    assert unit_sim(gpipe(p, m), p).peak_inflight == (m,) * p
    assert unit_sim(one_f_one_b(p, m), p).peak_inflight == tuple(min(p - s, m) for s in range(p))


@pytest.mark.parametrize("p, m", [(4, 8), (2, 4), (8, 8), (3, 5), (4, 4)])
def test_zb_h1_third_of_the_bubble_at_1f1b_peak_memory(p, m):
    one = unit_sim(one_f_one_b(p, m), p)
    zb = unit_sim(zb_h1(p, m), p)
    assert zb.bubble_fraction < one.bubble_fraction
    # Qi et al. 2024: bubble (p - 1)(T_F + T_B - T_W) = p - 1 slots, a third of 1F1B's 3(p - 1).
    assert zb.step_time_s == 3 * m + p - 1
    assert zb.bubble_fraction == (p - 1) / (3 * m + p - 1)
    # Memory: the peak over stages (stage 0's p) equals 1F1B's; every stage holds up to p
    # (the paper's claim is about the most loaded worker, not each stage's p - s).
    assert max(zb.peak_inflight) == max(one.peak_inflight) == p
    assert zb.peak_inflight[0] == one.peak_inflight[0]
    assert zb.peak_inflight == (p,) * p


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (4, 8, 3), (2, 4, 2), (8, 8, 2), (4, 4, 4), (3, 9, 2)])
def test_interleaved_bubble_closed_form(p, m, v):
    r = unit_sim(interleaved_1f1b(p, m, v), p * v)
    one = unit_sim(one_f_one_b(p, m), p)
    # Narayanan et al. 2021: bubble time (p - 1)(t_f + t_b) / v against ideal m (t_f + t_b),
    # so as a fraction of the step: ((p - 1) / v) / (m + (p - 1) / v) = (p - 1) / (v m + p - 1).
    assert r.bubble_fraction == (p - 1) / (v * m + p - 1)
    assert r.bubble_fraction < one.bubble_fraction
    # Same model cut v times finer (each chunk 1/v of a stage): step 3 (m + (p - 1) / v).
    chunk_s = [1 / v] * (p * v)
    fine = simulate(interleaved_1f1b(p, m, v), f_s=chunk_s, b_s=chunk_s, w_s=chunk_s)
    assert fine.step_time_s == pytest.approx(3 * (m + (p - 1) / v))


def test_interleaved_peak_inflight_megatron_warmup():
    p, m, v = 4, 8, 2
    r = unit_sim(interleaved_1f1b(p, m, v), p * v, act_bytes=[10.0] * (p * v))
    # Megatron warm-up 2 (p - r - 1) + (v - 1) p chunk forwards, plus one in steady state.
    assert r.peak_inflight == tuple(2 * (p - rank - 1) + (v - 1) * p + 1 for rank in range(p))
    assert r.peak_activation_bytes == tuple(10.0 * n for n in r.peak_inflight)


def test_zb_h2_beats_zb_h1_when_w_is_cheap():
    p, m = 4, 8
    h1, h2 = unit_sim(zb_h1(p, m), p, w=0.5), unit_sim(zb_h2(p, m), p, w=0.5)
    assert h2.step_time_s < h1.step_time_s
    assert max(h2.peak_inflight) <= 2 * p - 1
    # One step with T_F = T_B = T_W: both end at 3m + p - 1 (ZB-H2's edge needs overlap of steps).
    assert unit_sim(zb_h2(p, m), p).step_time_s == unit_sim(zb_h1(p, m), p).step_time_s == 3 * m + p - 1


@pytest.mark.parametrize("p, m", [(4, 7), (3, 9), (2, 3)])
def test_zb_h2_parallelogram_without_inner_gaps(p, m):
    r = unit_sim(zb_h2(p, m), p)
    for rank in range(p):
        spans = sorted((s, e) for rr, _, s, e in r.timeline if rr == rank)
        assert spans[0][0] == rank and spans[-1][1] == rank + 3 * m
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


# ---------------------------------------------------------------- simulator details


def test_p2p_latency_and_timeline():
    r = unit_sim(one_f_one_b(2, 1), 2, p2p_s=0.25)
    assert r.step_time_s == 6.5  # F 1, hop, F 1, BW 2, hop, BW 2
    assert [(rank, str(a), s, e) for rank, a, s, e in r.timeline] == [
        (0, "0F0", 0.0, 1.0),
        (1, "1F0", 1.25, 2.25),
        (1, "1BW0", 2.25, 4.25),
        (0, "0BW0", 4.5, 6.5),
    ]
    assert r.peak_activation_bytes is None


def test_p2p_per_cut():
    """Each cut its own hop time (stage 1 -> 2 crossing nodes, say): both directions pay it."""
    r = unit_sim(one_f_one_b(3, 1), 3, p2p_s=[0.25, 2.0])
    assert r.step_time_s == 3 * 1 + 3 * 2 + 2 * (0.25 + 2.0)  # F F F, BW BW BW, each cut twice
    starts = {str(a): s for _, a, s, _ in r.timeline}
    assert starts["1F0"] == 1.25 and starts["2F0"] == 4.25 and starts["1BW0"] == 9.25
    # interleaved on 2 ranks: stage 1 -> 2 (rank 1 back to rank 0) is the middle cut; micro-batch 1
    # waits on micro-batch 0 there once forward and once backward; the same time on every cut is the scalar
    sched = interleaved_1f1b(2, 2, 2)
    assert unit_sim(sched, 4, p2p_s=[0.0, 5.0, 0.0]).step_time_s == unit_sim(sched, 4).step_time_s + 2 * 5.0
    assert unit_sim(sched, 4, p2p_s=[5.0] * 3).step_time_s == unit_sim(sched, 4, p2p_s=5.0).step_time_s
    with pytest.raises(ValueError, match="one per cut"):
        unit_sim(one_f_one_b(3, 1), 3, p2p_s=[0.25])


def test_p2p_gradients_back_priced_apart():
    """The gradient message back across a cut has its own time (its own size: a sequence-sharded
    gradient, an activation that relays values needing none): forward hops pay p2p_s, backward
    hops p2p_back_s."""
    r = unit_sim(one_f_one_b(3, 1), 3, p2p_s=[0.25, 2.0], p2p_back_s=[0.5, 1.0])
    starts = {str(a): s for _, a, s, _ in r.timeline}
    assert starts["1F0"] == 1.25 and starts["2F0"] == 4.25 and starts["1BW0"] == 8.25
    assert starts["0BW0"] == 10.75 and r.step_time_s == 3 + 6 + 0.25 + 2.0 + 1.0 + 0.5
    same = unit_sim(one_f_one_b(3, 1), 3, p2p_s=[0.25, 2.0], p2p_back_s=[0.25, 2.0])
    assert same.step_time_s == unit_sim(one_f_one_b(3, 1), 3, p2p_s=[0.25, 2.0]).step_time_s
    with pytest.raises(ValueError, match="p2p_back_s must be >= 0"):
        unit_sim(one_f_one_b(3, 1), 3, p2p_back_s=[0.25, -1.0])


def test_act_bytes_weighted_per_stage():
    r = unit_sim(one_f_one_b(4, 8), 4, act_bytes=[1.0, 2.0, 3.0, 4.0])
    assert r.peak_activation_bytes == (4.0, 6.0, 6.0, 4.0)


def test_simulate_rejects_bad_times():
    with pytest.raises(ValueError, match="b_s has 3 entries"):
        simulate(one_f_one_b(2, 2), f_s=[1.0, 1.0], b_s=[1.0] * 3, w_s=[1.0, 1.0])
    with pytest.raises(ValueError, match="w_s must be >= 0"):
        simulate(one_f_one_b(2, 2), f_s=[1.0, 1.0], b_s=[1.0, 1.0], w_s=[1.0, -1.0])


def test_simulate_detects_deadlock():
    # Valid per rank, but rank 1 runs micro-batch 1 first while rank 0 waits on micro-batch 0's backward.
    sched = hand(["0F0 0BW0 0F1 0BW1", "1F1 1BW1 1F0 1BW0"])
    validate_schedule(sched, 2, 2)
    stuck = r"deadlock.*rank 0 at 0BW0 waits for 1B0.*rank 1 at 1F1 waits for 0F1"
    with pytest.raises(ValueError, match=stuck):
        unit_sim(sched, 2)
    with pytest.raises(ValueError, match="deadlock"):
        with_comm(sched, 2)


# ---------------------------------------------------------------- validation and API errors


def test_validate_catches_missing_w():
    sched = zb_h1(2, 2)
    sched[1].remove(Action(1, "W", 1))
    with pytest.raises(ValueError, match="missing 1W1"):
        validate_schedule(sched, 2, 2)


def test_validate_catches_w_before_b():
    sched = hand(["0F0 0B0 0W0", "1F0 1W0 1B0"])
    with pytest.raises(ValueError, match="1W0 runs before 1B0"):
        validate_schedule(sched, 2, 1)


def test_validate_catches_wrong_rank_duplicates_and_mixed_backward():
    with pytest.raises(ValueError, match="1F0 belongs on rank 1") as e:
        validate_schedule(hand(["0F0 1F0 0BW0 0BW0", "1BW0"]), 2, 1)
    assert "0BW0 appears more than once" in str(e.value)
    with pytest.raises(ValueError, match="both present"):
        validate_schedule(hand(["0F0 0B0 0BW0 0W0"]), 1, 1)


def test_generator_argument_errors():
    with pytest.raises(ValueError, match="n_micro divisible by n_ranks.*n_micro=6, n_ranks=4"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="n_virtual"):
        interleaved_1f1b(4, 8, 1)
    for gen in (gpipe, one_f_one_b, zb_h1, zb_h2):
        with pytest.raises(ValueError, match="n_micro must be an int >= 1"):
            gen(4, 0)
        with pytest.raises(ValueError, match="n_stages must be an int >= 1"):
            gen(0, 4)
    with pytest.raises(ValueError, match="gpipe, 1f1b, interleaved, zb-h1, zb-h2"):
        make_schedule("pipedream", n_stages=2, n_micro=2)
    with pytest.raises(ValueError, match="n_virtual=2"):
        make_schedule("1f1b", n_stages=2, n_micro=2, n_virtual=2)


# ---------------------------------------------------------------- display and lowering


def test_format_grid_2x2_1f1b():
    assert format_grid(one_f_one_b(2, 2)) == (
        "step  rank0  rank1\n"
        "0     0F0    .\n"
        "1     0F1    1F0\n"
        "2     .      1BW0\n"
        "3     0BW0   1F1\n"
        "4     .      1BW1\n"
        "5     0BW1   ."
    )


def _check_comm(sched, n_stages):
    comm = with_comm(sched, n_stages)
    n_ranks = len(sched)
    # Compute actions keep their per-rank order.
    for rank, acts in sched.items():
        assert [x for x in comm[rank] if "SEND" not in x and "RECV" not in x] == [str(a) for a in acts]
    # Every SEND has its RECV on the peer, and per (sender, receiver) pair the orders agree.
    sends, recvs = {}, {}
    for rank, ops in comm.items():
        for op in ops:
            stage, _, rest = op.partition("SEND_") if "SEND_" in op else op.partition("RECV_")
            if not rest:
                continue
            tag, mb = rest[0], int(rest[1:])
            if "SEND_" in op:
                peer_stage = int(stage) + (1 if tag == "F" else -1)
                sends.setdefault((rank, peer_stage % n_ranks), []).append((peer_stage, tag, mb))
            else:
                src = (int(stage) + (-1 if tag == "F" else 1)) % n_ranks
                recvs.setdefault((src, rank), []).append((int(stage), tag, mb))
    assert sends == recvs
    # A RECV precedes the compute action that consumes it.
    for rank, ops in comm.items():
        for i, op in enumerate(ops):
            if "RECV_F" in op:
                stage, mb = op.split("RECV_F")
                assert ops.index(f"{stage}F{mb}") > i
    # Run with blocking rendezvous p2p (SEND and RECV complete together): never stuck.
    pos = {r: 0 for r in comm}
    while any(pos[r] < len(comm[r]) for r in comm):
        moved = False
        for r in comm:
            while pos[r] < len(comm[r]):
                op = comm[r][pos[r]]
                if "SEND_" in op or "RECV_" in op:
                    kind = "SEND_" if "SEND_" in op else "RECV_"
                    stage, rest = op.split(kind)
                    tag = rest[0]
                    if kind == "SEND_":
                        ps = int(stage) + (1 if tag == "F" else -1)
                        peer, want = ps % n_ranks, f"{ps}RECV_{rest}"
                    else:
                        ps = int(stage) + (-1 if tag == "F" else 1)
                        peer, want = ps % n_ranks, f"{ps}SEND_{rest}"
                    if pos[peer] >= len(comm[peer]) or comm[peer][pos[peer]] != want:
                        break
                    pos[peer] += 1
                pos[r] += 1
                moved = True
        assert moved, {r: comm[r][pos[r]] for r in comm if pos[r] < len(comm[r])}
    return comm


def test_with_comm_1f1b_2x2():
    comm = _check_comm(one_f_one_b(2, 2), 2)
    assert comm[0][:3] == ["0F0", "0SEND_F0", "0F1"]
    assert "1RECV_F0" in comm[1] and "0RECV_B1" in comm[0] and "1SEND_B1" in comm[1]


@pytest.mark.parametrize("kind, p, m, v", [("gpipe", 3, 4, 1), ("zb-h1", 4, 8, 1), ("zb-h2", 3, 6, 1),
                                           ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3)])
def test_with_comm_pairs_match_and_cannot_deadlock(kind, p, m, v):
    _check_comm(make_schedule(kind, n_stages=p, n_micro=m, n_virtual=v), p * v)


def test_with_comm_single_rank_interleaved_has_no_p2p():
    comm = with_comm(interleaved_1f1b(1, 2, 2), 2)
    assert not [op for op in comm[0] if "SEND" in op or "RECV" in op]


# ---------------------------------------------------------------- property: every generator


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(SCHEDULE_KINDS),
    p=st.integers(1, 8),
    m=st.integers(1, 20),
    v=st.integers(2, 4),
    w=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    p2p=st.sampled_from([0.0, 0.1]),
)
def test_every_generator_valid_and_deadlock_free(kind, p, m, v, w, p2p):
    if kind == "interleaved":
        m = p * (1 + m % 4)
    else:
        v = 1
    n_stages = p * v
    sched = make_schedule(kind, n_stages=p, n_micro=m, n_virtual=v)
    validate_schedule(sched, n_stages, m)
    r = unit_sim(sched, n_stages, w=w, p2p_s=p2p)
    counts = Counter(a.kind for acts in sched.values() for a in acts)
    assert counts["F"] == n_stages * m
    assert r.busy_s == pytest.approx([m * v * (2 + w)] * p)
    assert 0.0 <= r.bubble_fraction < 1.0
    assert len(r.timeline) == sum(len(acts) for acts in sched.values())
    for rank in range(p):  # a rank runs one action at a time, in its list order
        spans = [(a, s, e) for rr, a, s, e in r.timeline if rr == rank]
        assert [a for a, _, _ in spans] == sched[rank]
        assert all(x[2] <= y[1] for x, y in zip(spans, spans[1:]))


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
@pytest.mark.parametrize("p, m", [(1, 3), (2, 2), (3, 5), (4, 8), (5, 4)])
def test_timing_order_is_a_dependency_order_with_its_waits(kind, p, m):
    """Every action of the schedule once, after the one before it on its rank and after the
    actions it needs; each wait names the needed action, the cut its input crosses (-1 on the
    same rank) and whether it is a gradient (the timing passes read nothing else)."""
    from autopar.cost.schedule import cached_schedule, timing_order

    if kind == "interleaved":
        m += -m % p  # (its micro-batches come in rounds of p)
    for v in (2, 3) if kind == "interleaved" else (1,):
        sched = cached_schedule(kind, p, m, v)
        order = timing_order(kind, p, m, v)
        stages = p * v
        assert Counter((r, a) for r, a, _ in order) == Counter((r, a) for r in sched for a in sched[r])
        index = {}
        for i, (r, a, waits) in enumerate(order):
            mine = [x for x, (q, _, _) in enumerate(order[:i]) if q == r]
            assert [order[x][1] for x in mine] == sched[r][:len(mine)]  # its rank's list, in order
            needs = []
            if a.kind == "F" and a.stage:
                needs.append(("F", a.stage - 1, 0))
            if a.kind in ("B", "BW"):
                needs.append(("F", a.stage, 0))
                if a.stage + 1 < stages:
                    needs.append(("B", a.stage + 1, 1))
            if a.kind == "W":
                needs.append(("B", a.stage, 1))
            expected = tuple((index[kind_, s, a.microbatch], -1 if s % p == r else min(s, a.stage), back)
                             for kind_, s, back in needs)
            assert waits == expected, (kind, p, m, v, a)
            if a.kind != "W":
                index["F" if a.kind == "F" else "B", a.stage, a.microbatch] = i
