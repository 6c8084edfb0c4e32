"""The step program and its two-stream simulation, checked against hand-computed timelines.

Link: 1 GB/s, no latency, so a bucket of B bytes over dp = 2 takes B/1e9 s to all-reduce
(2 (n-1)/n = 1) and B/2e9 s to all-gather or reduce-scatter ((n-1)/n = 1/2).
"""

import pytest

from autopar.cost import comm
from autopar.cost.schedule import one_f_one_b
from autopar.cost.simulate import simulate, simulate_program, simulate_step
from autopar.cost.step import (GroupCost, Op, StageCost, StepSpec, TiedCost, dp_collective_s, lower_step,
                                time_prefix)

LINK = comm.Link(bytes_per_s=1e9, latency_s=0.0)
OTHER = comm.Link(bytes_per_s=1e9, latency_s=1e-12)  # a second link (different figures)


def spec(groups, *, zero=0, dp=2, m=1, pp=1, kind="1f1b", slowdown=1.0, opt=0.0, send=0.0, back=None, tied=()):
    stages = tuple(StageCost(groups=tuple(GroupCost(name=f"s{s}g{g}", f_s=f, b_s=b, w_s=w, bucket_bytes=n)
                                          for g, (f, b, w, n) in enumerate(gs)), optimizer_s=opt, send_s=send,
                             send_back_s=back)
                   for s, gs in enumerate(groups))
    return StepSpec(schedule=kind, pp=pp, microbatches=m, zero=zero, dp=dp, stages=stages, dp_link=LINK,
                    tied=tied, overlap_slowdown=slowdown)


def spans(res):
    return {op.name: (t0, t1) for _, op, t0, t1 in res.timeline}


def test_first_bucket_hidden_behind_the_backward_last_exposed():
    # two groups, F = 1 and BW = 2 each; each all-reduce 1 s. The backward runs g1 (2..4) then
    # g0 (4..6); g1's bucket reduces 4..5 behind g0's backward; g0's (6..7) has nothing to hide behind.
    res = simulate_step(spec([[(1, 1, 1, 1e9), (1, 1, 1, 1e9)]], opt=0.5))
    t = spans(res)
    assert t["0F0"] == (0, 2) and t["0BW0.g1"] == (2, 4) and t["0BW0.g0"] == (4, 6)
    assert t["0REDUCE_GRAD0.g1"] == (4, 5) and t["0REDUCE_GRAD0.g0"] == (6, 7)
    assert t["0OPT"] == (7, 7.5) and res.step_time_s == 7.5
    assert res.comm_s == (2.0,) and res.hidden_s == (1.0,) and res.exposed_s == (1.0,)


def test_a_bucket_longer_than_the_rest_of_the_backward_is_partly_exposed():
    # g1's bucket takes 3 s (4..7) but g0's backward ends at 6; g0's bucket queues behind it on
    # the reduce stream (7..8): 2 s hidden, 2 s exposed.
    res = simulate_step(spec([[(1, 1, 1, 1e9), (1, 1, 1, 3e9)]]))
    t = spans(res)
    assert t["0REDUCE_GRAD0.g1"] == (4, 7) and t["0REDUCE_GRAD0.g0"] == (7, 8)
    assert res.step_time_s == 8 and res.hidden_s == (2.0,) and res.exposed_s == (2.0,)


def test_compute_slows_only_while_a_collective_overlaps_it():
    # as the first case with a 1.3x slowdown: F and g1's backward run alone at full speed; g0's
    # backward does 1/1.3 s of work during the 1 s reduction, then the rest at full speed.
    res = simulate_step(spec([[(1, 1, 1, 1e9), (1, 1, 1, 1e9)]], slowdown=1.3))
    t = spans(res)
    assert t["0F0"] == (0, 2) and t["0BW0.g1"] == (2, 4)
    g0_end = 5 + (2 - 1 / 1.3)
    assert t["0BW0.g0"] == pytest.approx((4, g0_end))
    assert t["0REDUCE_GRAD0.g0"] == pytest.approx((g0_end, g0_end + 1))
    assert res.busy_s[0] == pytest.approx(4 + 1 + (2 - 1 / 1.3))


def test_zero3_prefetch_hides_the_next_groups_gather():
    # ZeRO-3, each gather 0.5 s: g0's forward gather is exposed (0..0.5); g1's is issued when
    # g0's forward starts and is done (0.5..1) before g0's forward ends (1.5); the backward's
    # gathers are issued one group ahead too; only the first gather and the last bucket wait
    # (0.5 s each), the other four collectives (0.5 s each) run under compute.
    res = simulate_step(spec([[(1, 1, 1, 1e9), (1, 1, 1, 1e9)]], zero=3))
    t = spans(res)
    assert t["0UNSHARD_F0.g0"] == (0, 0.5) and t["0F0.g0"] == (0.5, 1.5)
    assert t["0UNSHARD_F0.g1"] == (0.5, 1.0) and t["0F0.g1"] == (1.5, 2.5)
    assert t["0UNSHARD_B0.g1"] == (1.5, 2.0) and t["0BW0.g1"] == (2.5, 4.5)
    assert t["0UNSHARD_B0.g0"] == (2.5, 3.0) and t["0BW0.g0"] == (4.5, 6.5)
    assert t["0REDUCE_GRAD0.g1"] == (4.5, 5.0) and t["0REDUCE_GRAD0.g0"] == (6.5, 7.0)
    assert res.step_time_s == 7.0 and res.exposed_s == (1.0,) and res.hidden_s == (2.0,)  # 4 of 6 hidden
    kinds = [op.kind for op in lower_step(spec([[(1, 1, 1, 1e9)] * 2], zero=3))[0]]
    assert "PARAM_GATHER" not in kinds and kinds.count("UNSHARD") == 4  # forward and backward, two groups


def test_two_collectives_sharing_a_link_take_the_sum():
    # 1 s and 2 s alone, issued together on two streams of one rank: on one link each runs at
    # half speed while both are in flight, so the first ends at 2 and the second at 3 (the sum);
    # on two links they do not slow each other.
    def run(link_b):
        program = {0: [Op("a", "UNSHARD", 1.0, stream="x", link=LINK),
                       Op("b", "REDUCE_GRAD", 2.0, stream="y", link=link_b)]}
        return spans(simulate_program(program))
    assert run(LINK) == {"a": (0, 2), "b": (0, 3)}
    assert run(OTHER) == {"a": (0, 1), "b": (0, 2)}


def test_one_stream_runs_its_collectives_in_issue_order():
    program = {0: [Op("a", "REDUCE_GRAD", 1.0, stream="x", link=LINK),
                   Op("b", "REDUCE_GRAD", 2.0, stream="x", link=LINK)]}
    assert spans(simulate_program(program)) == {"a": (0, 1), "b": (1, 3)}


def test_zero_stages_issue_what_zero_def_says():
    one = [[(1, 1, 1, 1e9), (1, 1, 1, 1e9)]]

    def count(zero):
        ops = [op for op in lower_step(spec(one, zero=zero, m=3))[0] if op.stream]
        return sorted((op.kind, op.collective) for op in ops)
    assert count(0) == [("REDUCE_GRAD", "all_reduce")] * 2  # once a step per bucket
    assert count(1) == [("PARAM_GATHER", "all_gather")] * 2 + [("REDUCE_GRAD", "reduce_scatter")] * 2
    assert count(2) == [("PARAM_GATHER", "all_gather")] * 2 + [("REDUCE_GRAD", "reduce_scatter")] * 6
    assert count(3) == [("REDUCE_GRAD", "reduce_scatter")] * 6 + [("UNSHARD", "all_gather")] * 12
    assert not [op for op in lower_step(spec(one, zero=3, dp=1, m=3))[0] if op.stream]  # dp = 1: nothing


def test_pipeline_p2p_and_tied_all_reduce():
    # pp = 2, one micro-batch, F = B = W = 1 (fused BW = 2), p2p 0.5: F0 0..1, recv at 1.5, F1 1.5..2.5,
    # BW1 2.5..4.5, recv 5, BW0 5..7. A parameter tied between the stages is all-reduced (2 ranks,
    # 1 s) once both backwards are done, 7..8, then both optimizers (0.25) run: 8.25.
    tied = (TiedCost(name="wte.weight", stages=(0, 1), groups=(0, 0), nbytes=1e9, link=LINK),)
    s = spec([[(1, 1, 1, 0)], [(1, 1, 1, 0)]], pp=2, dp=1, send=0.5, opt=0.25, tied=tied)
    program = lower_step(s)
    assert [str(op) for op in program[0]] == ["0F0", "0SEND_F0", "1RECV_B0", "0BW0", "TIED_REDUCE wte.weight",
                                              "0OPT"]
    assert [str(op) for op in program[1]] == ["0RECV_F0", "1F0", "1BW0", "1SEND_B0", "TIED_REDUCE wte.weight",
                                              "1OPT"]
    res = simulate_step(s)
    t = spans(res)
    assert t["1F0"] == (1.5, 2.5) and t["0BW0"] == (5, 7) and t["TIED_REDUCE wte.weight"] == (7, 8)
    assert t["1OPT"] == (8, 8.25) and res.step_time_s == 8.25
    assert res.exposed_s == (1.0, 1.0)


def test_two_tied_parameters_reduce_in_one_order_on_every_rank():
    # a word embedding in stage 0's first group and the last stage's last group, a projection
    # the other way round (NeoMME): in backward order rank 0 would finish the projection first and
    # rank 1 the embedding, and a stream that runs collectives in issue order would wait forever.
    # Both ranks issue them by name after their last backward, as the runtime sums them.
    tied = (TiedCost(name="proj.weight", stages=(0, 1), groups=(1, 0), nbytes=1e9, link=LINK),
            TiedCost(name="emb.weight", stages=(0, 1), groups=(0, 1), nbytes=1e9, link=LINK))
    for zero, dp in ((0, 1), (1, 2), (3, 2)):
        s = spec([[(1, 1, 1, 1e6)] * 2, [(1, 1, 1, 1e6)] * 2], pp=2, dp=dp, zero=zero, send=0.5, opt=0.25, tied=tied)
        program = lower_step(s)
        for rank in (0, 1):
            assert [op.name for op in program[rank] if op.kind == "TIED_REDUCE"] == ["TIED_REDUCE emb.weight",
                                                                                     "TIED_REDUCE proj.weight"]
        res = simulate_step(s)  # before: "step program deadlocks: rank 0 at 0OPT waits for TIED_REDUCE ..."
        t = spans(res)
        assert t["TIED_REDUCE emb.weight"][1] == t["TIED_REDUCE proj.weight"][0]  # one after the other
        assert t["TIED_REDUCE proj.weight"][1] <= t["0OPT"][0]
        reduced = [e for name, (_, e) in t.items() if "REDUCE_GRAD" in name]
        assert len(reduced) == (0 if dp == 1 else 4)  # one per group and stage (m = 1)
        assert all(e <= t["TIED_REDUCE emb.weight"][0] for e in reduced)  # after the dp buckets, as the runtime


def test_pipeline_only_matches_the_schedule_simulator():
    # no dp, no optimizer: the step program's compute is the plain pipeline simulation
    s = spec([[(1, 1, 1, 1e9)], [(1, 2, 0.5, 1e9)]], pp=2, dp=1, m=4, send=0.25)
    res = simulate_step(s)
    pipe = simulate(one_f_one_b(2, 4), f_s=[1, 1], b_s=[2, 2.5], w_s=[0, 0], p2p_s=0.25)
    assert res.step_time_s == pipe.step_time_s and res.bubble_fraction == pytest.approx(pipe.bubble_fraction)


def test_gradient_messages_back_take_their_own_time():
    # as above with the activation 0.5 s forward and its gradient 1.5 s back: F0 0..1, F1 1.5..2.5,
    # BW1 2.5..4.5, BW0 6..8; the bare pipeline simulator agrees; a spec written before the two
    # were priced apart (no send_back_s) prices the gradients at send_s
    s = spec([[(1, 1, 1, 0)], [(1, 1, 1, 0)]], pp=2, dp=1, send=0.5, back=1.5)
    t = spans(simulate_step(s))
    assert t["1F0"] == (1.5, 2.5) and t["0BW0"] == (6, 8) and simulate_step(s).step_time_s == 8
    sends = {op.name: op.seconds for ops in lower_step(s).values() for op in ops if op.kind == "SEND"}
    assert sends == {"0SEND_F0": 0.5, "1SEND_B0": 1.5}
    pipe = simulate(one_f_one_b(2, 1), f_s=[1, 1], b_s=[2, 2], w_s=[0, 0], p2p_s=0.5, p2p_back_s=1.5)
    assert pipe.step_time_s == 8
    old = s.to_dict()
    for st in old["stages"]:
        del st["send_back_s"]
    assert simulate_step(StepSpec.from_dict(old)).step_time_s == simulate_step(spec(
        [[(1, 1, 1, 0)], [(1, 1, 1, 0)]], pp=2, dp=1, send=0.5)).step_time_s == 7
    assert StepSpec.from_dict(s.to_dict()) == s


def test_expert_buckets_run_over_their_replica_group_on_its_link():
    """Under ep, a group's expert bytes are reduced and gathered over the replica group on its own
    link, the rest over dp (the runtime's two buckets, one after the other); with one replica the
    experts need no collective. dp = 2 on LINK: all-reduce B/1e9 s; 4 replicas on a 4x slower
    link: all-reduce 2 (3/4) B / 0.25e9 = 6 B/1e9 s."""
    slow = comm.Link(bytes_per_s=0.25e9, latency_s=0.0)
    group = GroupCost(name="g", f_s=1, b_s=1, w_s=1, bucket_bytes=1e9, expert_bytes=0.75e9)
    base = spec([[(1, 1, 1, 1e9)]], zero=0)

    def reduce_s(replicas, link):
        s = StepSpec(**{**vars(base), "stages": (StageCost(groups=(group,)),), "replicas": replicas,
                        "replica_link": link})
        assert StepSpec.from_dict(s.to_dict()) == s
        (op,) = [op for op in lower_step(s)[0] if op.kind == "REDUCE_GRAD"]
        return op.seconds
    assert reduce_s(0, None) == pytest.approx(1.0)  # no ep: the whole bucket over dp
    assert reduce_s(4, slow) == pytest.approx(0.25 + 6 * 0.75)
    assert reduce_s(1, slow) == pytest.approx(0.25)  # ep = dp: each expert part lives on one rank
    assert dp_collective_s("all_gather", 1e9, 2, LINK, 0.75e9, 4, slow) == pytest.approx(0.125 + 0.75 * 3)


def test_spec_round_trips_and_bad_input_is_one_clear_error():
    s = spec([[(1, 1, 1, 1e9)], [(1, 1, 1, 1e9)]], pp=2, zero=2, m=2,
             tied=(TiedCost(name="w", stages=(0, 1), groups=(0, 0), nbytes=1.0, link=LINK),))
    assert StepSpec.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="stages are not a positive multiple of pp=2"):
        lower_step(spec([[(1, 1, 1, 0)]], pp=2))
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3"):
        lower_step(spec([[(1, 1, 1, 0)]], zero=4))
    with pytest.raises(ValueError, match="overlap_slowdown must be >= 1"):
        simulate_step(spec([[(1, 1, 1, 0)]], slowdown=0.5))


@pytest.mark.parametrize("kind, pp, m", [("gpipe", 2, 4), ("1f1b", 3, 5), ("interleaved", 2, 4), ("zb-h1", 3, 4),
                                         ("zb-h2", 2, 5), ("1f1b", 1, 3)])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_every_schedule_and_zero_stage_runs_between_its_bounds(kind, pp, m, zero):
    # uneven groups and buckets; the step can be no faster than its compute without any
    # communication, and no slower than everything (compute slowed by the overlap factor,
    # every collective, every transfer) run one after another
    v = 2 if kind == "interleaved" else 1
    groups = [[(1.0 + g, 0.5 * (s + 1), 0.75, (g + 1) * 4e8) for g in range(3)] for s in range(pp * v)]
    tied = (TiedCost(name="w", stages=(0, pp * v - 1), groups=(0, 2), nbytes=2e8, link=LINK),) if pp > 1 else ()
    s = spec(groups, zero=zero, dp=4, m=m, pp=pp, kind=kind, slowdown=1.2, opt=0.3, send=0.1, tied=tied)
    res = simulate_step(s)
    bare = simulate_step(spec(groups, zero=zero, dp=1, m=m, pp=pp, kind=kind, opt=0.3, send=0.1))
    program = lower_step(s)
    serial = sum(op.seconds * (1.2 if op.kind in ("F", "B", "W", "BW", "OPT") else 1.0)
                 for ops in program.values() for op in ops)
    assert bare.step_time_s <= res.step_time_s + 1e-9 and res.step_time_s <= serial + 1e-9
    for r in range(pp):
        assert res.hidden_s[r] + res.exposed_s[r] == pytest.approx(res.comm_s[r])
        assert res.comm_s[r] >= max(op.seconds for op in program[r] if op.stream) - 1e-9  # dp = 4: buckets
    done = {op.name for _, op, _, _ in res.timeline}
    assert done == {op.name for ops in program.values() for op in ops}  # every op ran


@pytest.mark.parametrize("kind, pp, m", [("gpipe", 2, 4), ("1f1b", 3, 7), ("interleaved", 2, 4), ("zb-h1", 4, 9),
                                         ("zb-h2", 3, 8), ("1f1b", 1, 3), ("interleaved", 3, 6)])
@pytest.mark.parametrize("zero, dp", [(0, 4), (1, 4), (1, 1), (2, 4), (3, 4)])
@pytest.mark.parametrize("tied", [False, True])
def test_search_timing_without_timeline_equals_the_event_engine(kind, pp, m, zero, dp, tied):
    # the search's timing (the start of each rank timed in one pass, the rest by the engine)
    # gives what the whole program through the engine gives, figure for figure: uneven stages,
    # groups, buckets, activation and gradient transfers, a tied parameter, overlap slowdown
    v = 2 if kind == "interleaved" else 1
    groups = [[(1.0 + g + 0.3 * s, 0.5 * (s + 1) + 0.1 * g, 0.75 - 0.05 * s, (g + 1) * 4e8) for g in range(3)]
              for s in range(pp * v)]
    ties = (TiedCost(name="w", stages=(0, pp * v - 1), groups=(0, 2), nbytes=2e8, link=OTHER),) if tied else ()
    stages = tuple(StageCost(groups=tuple(GroupCost(name=f"s{s}g{g}", f_s=f, b_s=b, w_s=w, bucket_bytes=n)
                                          for g, (f, b, w, n) in enumerate(gs)),
                             optimizer_s=0.3 + 0.01 * s, send_s=0.1 + 0.05 * s, send_back_s=0.2 - 0.01 * s)
                   for s, gs in enumerate(groups))
    s = StepSpec(schedule=kind, pp=pp, microbatches=m, zero=zero, dp=dp, stages=stages, dp_link=LINK,
                 tied=ties, overlap_slowdown=1.2)
    full, fast = simulate_step(s), simulate_step(s, timeline=False)
    assert fast.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)
    assert fast.bubble_fraction == pytest.approx(full.bubble_fraction, rel=1e-9, abs=1e-12)
    for field in ("busy_s", "comm_s", "hidden_s", "exposed_s"):
        assert getattr(fast, field) == pytest.approx(getattr(full, field), rel=1e-12, abs=1e-12), field
    assert fast.timeline == [] and full.timeline
    prefix = time_prefix(s)
    if zero >= 2 and dp > 1:
        assert prefix is None  # collectives from the first backward (or forward) on: nothing to gain
    else:
        # everything up to each stage's last weight gradient is timed without the engine
        timed = sum(prefix.done)
        assert timed + len(prefix.tail) == len(prefix.done)
        assert timed >= len(prefix.done) - pp * v * (2 * pp + 2)


def test_search_timing_of_a_deep_pipeline_lowers_only_its_end():
    # 16 ranks, 64 micro-batches, ZeRO-1: of 3072 actions the event engine sees only the ends
    groups = [[(1.0, 1.0, 0.5, 1e8)] for _ in range(16)]
    s = spec(groups, zero=1, dp=8, m=64, pp=16, kind="zb-h1", opt=0.1, send=0.05)
    prefix = time_prefix(s)
    assert len(prefix.done) == 3 * 64 * 16 and len(prefix.tail) < 0.2 * len(prefix.done)
    lowered = sum(len(ops) for ops in lower_step(s, prefix=prefix).values())
    assert lowered < 0.1 * sum(len(ops) for ops in lower_step(s).values())
    assert simulate_step(s, timeline=False).step_time_s == pytest.approx(simulate_step(s).step_time_s, rel=1e-12)


def test_cheap_estimate_of_exposed_dp_time():
    # what the search ranks candidates by before simulating: here it equals the simulation
    from autopar.cost.step import estimate_exposed_s, group_dp_s

    s = spec([[(1, 1, 1, 1e9), (1, 1, 1, 1e9)]])
    assert estimate_exposed_s(s.stages[0], zero=0, dp=2, link=LINK, microbatches=1) == 1.0
    assert simulate_step(s).exposed_s == (1.0,)
    assert group_dp_s(1e9, zero=3, dp=2, link=LINK, microbatches=2) == pytest.approx(2 * 0.5 + 4 * 0.5)
    assert estimate_exposed_s(s.stages[0], zero=0, dp=1, link=LINK, microbatches=1) == 0.0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_group_dp_s_prices_calibrated_links_as_the_step_program(zero):
    # the search's per-bucket figure must equal the simulated collectives: on an NVSwitch link
    # (measured busbw and latency by group size) and on a cross-node link (NCCL base latency,
    # its own all-reduce bandwidth), not the bare bandwidth/latency pair
    from autopar.cost.devices import lookup_device
    from autopar.cost.step import group_dp_s

    h100 = lookup_device("H100")
    for dp, stride in ((8, 1), (16, 1), (32, 8)):
        link = comm.group_link(group_size=dp, stride=stride, devices_per_node=8, device=h100)
        s = StepSpec(schedule="1f1b", pp=1, microbatches=2, zero=zero, dp=dp, dp_link=link,
                     stages=(StageCost(groups=(GroupCost(name="g", f_s=1.0, b_s=1.0, w_s=1.0, bucket_bytes=4e8),)),))
        ops = [op for op in lower_step(s)[0] if op.stream.startswith("dp")]
        assert group_dp_s(4e8, zero=zero, dp=dp, link=link, microbatches=2) == pytest.approx(
            sum(op.seconds for op in ops), rel=1e-12)
