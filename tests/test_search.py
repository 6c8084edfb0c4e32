"""The outer search: branch and bound that never prunes the optimum, rank-balanced
interleaved cuts, ZeRO by modelled cost (sequence parallelism: tests/test_search_sp.py).

Most cases run ``search`` on hand-made layer costs (no tracing), so they are exact and fast.
"""

from dataclasses import replace

import pytest

from autopar.cluster import parse_cluster
from autopar.planner import partition as P
from autopar.planner import search as S

H100x2 = parse_cluster("2x8xH100")


def _units(n: int, *, f_s=1e-3, params=50e6, act=2e8, comm_s=1e-4) -> list[S.Unit]:
    return [S.Unit(path=f"layers.{i}", f_s=f_s, b_s=f_s, w_s=f_s, comm_s=comm_s, cheap_f_s=f_s / 10,
                   act_bytes=act, cheap_act_bytes=act / 4, boundary_bytes=act / 10, n_params=params)
            for i in range(n)]


def _search(units, *, cluster=H100x2, fixed=None, batch=64, keep=S.KEEP, tp=(1, 2, 4, 8)):
    return S.search(units_for=lambda t, mbs, sp: [replace(u, f_s=u.f_s * mbs / t, b_s=u.b_s * mbs / t,
                                                           w_s=u.w_s * mbs / t, act_bytes=u.act_bytes * mbs / t,
                                                           n_params=u.n_params / t) for u in units],
                    n_units=len(units), global_batch=batch, cluster=cluster, fixed=S.Fixed.from_dict(fixed),
                    precision="mixed", tp_options=list(tp), keep=keep)


def test_pruned_search_equals_exhaustive_and_bounds_hold():
    """keep = everything: nothing can be pruned, every configuration is simulated; then every
    lower bound is below its simulated time, and the pruned search returns the same best."""
    units = _units(12)
    everything, stats = _search(units, keep=10**9)
    assert stats["simulated"] == stats["feasible"] > 100
    sharper = 0
    for c in everything:
        assert S.lower_bound_s(c) <= S.lower_bound_s(c, H100x2) <= c.step_time_s * (1 + 1e-12), c.config
        if c.config.pp > 1:
            assert S.pipeline_bound_s(c, H100x2) <= c.step_time_s * (1 + 1e-12), c.config
            sharper += S.pipeline_bound_s(c, H100x2) > S.lower_bound_s(c, H100x2) * 1.01
        cuts, i = [], 0
        for st in c.stages:
            cuts.append((i, i + len(st.layers)))
            i += len(st.layers)
        scaled = [replace(u, f_s=u.f_s * c.config.microbatch_size / c.config.tp,
                          b_s=u.b_s * c.config.microbatch_size / c.config.tp,
                          w_s=u.w_s * c.config.microbatch_size / c.config.tp, n_params=u.n_params / c.config.tp)
                  for u in units]
        prefix = S._prefix_sums(scaled, c.config.recompute)
        cfg = c.config
        dp_prefix = S._dp_comm_prefix(scaled, zero=cfg.zero, dp=cfg.dp, link=H100x2.link_for_group(cfg.dp, stride=cfg.tp),
                                      microbatches=cfg.microbatches, precision="mixed")
        assert S._cuts_bound_s(prefix, cuts, cfg, cluster=H100x2, precision="mixed", dp_prefix=dp_prefix) \
            <= S.lower_bound_s(c, H100x2) * (1 + 1e-12), cfg
    assert sharper > 100  # the bare pipeline's bubble bounds more tightly than the compute alone
    pruned, stats2 = _search(units)
    assert stats2["simulated"] < stats["simulated"] / 4  # the bound does prune
    assert [c.config for c in pruned] == [c.config for c in everything[:S.KEEP]]
    assert [c.step_time_s for c in pruned] == [c.step_time_s for c in everything[:S.KEEP]]


@pytest.mark.parametrize("kind, pp, m, v", [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("zb-h1", 4, 8, 1),
                                             ("zb-h2", 4, 8, 1), ("interleaved", 3, 6, 2),
                                             ("interleaved", 2, 4, 4)])
def test_bare_pipeline_pass_equals_the_event_simulation(kind, pp, m, v):
    """The bound's one-pass timing (bounds.bare_pipeline_ends) gives each rank's end of compute
    exactly as the event engine does (simulate_stages), with unequal stages and per-cut p2p,
    the gradients back at their own (smaller) times."""
    import random

    from autopar.planner import bounds

    rng = random.Random(pp * 100 + m * 10 + v)
    n = pp * v
    f = [rng.uniform(0.5, 2.0) for _ in range(n)]
    b = [x * rng.uniform(1.0, 2.5) for x in f]
    w = [x * rng.uniform(0.3, 1.0) for x in f]
    p2p = [rng.uniform(0.0, 0.4) for _ in range(n - 1)]
    back = [x * rng.uniform(0.3, 1.0) for x in p2p]
    sim = S.simulate_stages(kind, microbatches=m, f_s=f, b_s=b, w_s=w, p2p_s=p2p, pp=pp, p2p_back_s=back)
    last = [0.0] * pp
    for r, _, _, end in sim.timeline:
        last[r] = max(last[r], end)
    fast = bounds.bare_pipeline_ends(kind, pp=pp, microbatches=m, f_s=f, b_s=b, w_s=w, p2p_s=p2p, p2p_back_s=back)
    assert fast == pytest.approx(last, rel=1e-12)
    assert max(fast) == pytest.approx(sim.step_time_s, rel=1e-12)


def test_zero_stage_by_modelled_cost_not_first_fit():
    """Every stage fits; a sharded optimizer step makes a higher stage the fastest (which one
    depends on how much of its collectives the step program hides), and the old loop (stop
    at the first stage that fits, ZeRO-0) missed it."""
    units = _units(8, params=400e6)
    best, _ = _search(units, fixed={"pp": 1}, tp=(1,))
    times = {z: _search(units, fixed={"pp": 1, "zero": z}, tp=(1,))[0][0].step_time_s for z in range(4)}
    fastest = min(times, key=lambda z: (float(f"{times[z]:.6g}"), z))
    assert best[0].config.zero == fastest != 0, times
    assert times[1] < times[0]
    assert best[0].step_time_s == times[fastest]


def test_grad_sync_follows_zero_def():
    link = H100x2.link_for_group(16, stride=1)
    one = S.grad_sync_s(1e9, zero=1, dp=16, microbatches=4, link=link)
    two = S.grad_sync_s(1e9, zero=2, dp=16, microbatches=4, link=link)
    three = S.grad_sync_s(1e9, zero=3, dp=16, microbatches=4, link=link)
    from autopar.cost import comm
    rs, ag = comm.reduce_scatter_s(1e9, 16, link), comm.all_gather_s(1e9, 16, link)
    assert one == pytest.approx(rs + ag)
    assert two == pytest.approx(4 * rs + ag)  # stage 2 reduces every micro-batch
    assert three == pytest.approx(4 * rs + 8 * ag)
    assert S.grad_sync_s(1e9, zero=0, dp=1, microbatches=4, link=link) == 0.0


def _rank_layers(cuts, pp):
    per_rank = [0] * pp
    for s, (i, j) in enumerate(cuts):
        per_rank[s % pp] += j - i
    return per_rank


def test_interleaved_cuts_balance_ranks_not_stages():
    """8 equal layers on 2 ranks x 3 chunks: the stage-balanced cuts 1,1,1,2,1,2 (slowest
    stage 2, the optimum) give rank 0 three layers and rank 1 five; 1,1,2,1,1,2 has the
    same slowest stage and gives both ranks four."""
    units = _units(8)
    cfg = S.Config(tp=1, pp=2, dp=1, microbatch_size=1, microbatches=4, zero=0, recompute="none",
                   schedule="interleaved", virtual_stages=3)
    per_stage = P._partition(units, replace(cfg, schedule="1f1b", virtual_stages=1, pp=6), cap=1e15,
                             state_per_param=16, inflight=(4,) * 6)
    assert max(j - i for i, j in per_stage) == 2
    assert _rank_layers(per_stage, 2) == [3, 5]  # what balancing stages alone gives
    cuts = P._partition(units, cfg, cap=1e15, state_per_param=16, inflight=(4,) * 6)
    assert _rank_layers(cuts, 2) == [4, 4], cuts
    assert max(j - i for i, j in cuts) == 2
    # and the search's own candidate under that configuration has equal rank loads
    ranked, _ = _search(units, fixed={"pp": 2, "dp": 1, "schedule": "interleaved", "virtual_stages": 3,
                                      "microbatches": 4}, tp=(1,), batch=4, cluster=parse_cluster("1x2xH100"))
    assert _rank_layers([(0, 0)] * 0 + [(0, len(st.layers)) for st in ranked[0].stages], 2) == [4, 4]


def test_balancing_respects_memory():
    """A move that would overfill a stage is not taken: with room for two layers per stage
    only, the cuts keep every stage at two layers or fewer."""
    units = _units(8)
    cfg = S.Config(tp=1, pp=2, dp=1, microbatch_size=1, microbatches=4, zero=0, recompute="none",
                   schedule="interleaved", virtual_stages=3)
    per_layer = 16 * units[0].n_params + 4 * units[0].act_bytes
    cuts = P._partition(units, cfg, cap=2.5 * per_layer, state_per_param=16, inflight=(4,) * 6)
    assert max(j - i for i, j in cuts) <= 2
    assert _rank_layers(cuts, 2) == [4, 4]


def test_memoised_capped_cuts_equal_fresh_ones():
    """The partitioner's memo (running sums shared per units, the capped bisection started at
    the uncapped bound, the total-memory shortcut) finds cuts that fit with the slowest stage
    a fresh partition finds, or None where that finds None, under caps from roomy to
    infeasible."""
    import random

    rng = random.Random(7)
    units = [replace(u, f_s=u.f_s * rng.uniform(0.5, 2.0), act_bytes=u.act_bytes * rng.uniform(0.5, 2.0),
                     transient_bytes=rng.uniform(0, 1e8)) for u in _units(24)]
    per_layer = 16 * units[0].n_params + 4 * units[0].act_bytes
    memo = {}
    seen = set()
    for pp, v, kind in ((2, 1, "1f1b"), (4, 1, "zb-h1"), (4, 2, "interleaved"), (2, 4, "interleaved")):
        for recompute in ("none", "full"):
            for scale in (100.0, 8.0, 5.0, 3.5, 2.5, 1.5, 0.5):
                cfg = S.Config(tp=1, pp=pp, dp=1, microbatch_size=1, microbatches=8, zero=0, recompute=recompute,
                               schedule=kind, virtual_stages=v)
                inflight = P._inflight(kind, pp, 8, v)
                rule = dict(cap=scale * per_layer, state_per_param=16, inflight=inflight)
                fresh = P._partition(units, cfg, **rule)
                memoised = P._partition(units, cfg, **rule, memo=memo)
                seen.add(fresh is None)
                assert (memoised is None) == (fresh is None), (pp, v, recompute, scale)
                if fresh is not None:
                    layers = P._Layers(units, recompute)
                    assert all(layers.fits(i, j, s, **rule) for s, (i, j) in enumerate(memoised)) or P._ranks_fit(
                        layers, memoised, cfg, cap=rule["cap"] * v, state_per_param=16, buffers=(0.0, 0.0),
                        expert_per_param=0.0)
                    assert max(layers.pre_t[j] - layers.pre_t[i] for i, j in memoised) == pytest.approx(
                        max(layers.pre_t[j] - layers.pre_t[i] for i, j in fresh), rel=1e-9)
    assert seen == {True, False}  # both outcomes were exercised


def test_interleaved_cuts_fit_ranks_not_stages():
    """An interleaved rank's stages peak at different moments (rank_states), so a layout can fit
    the rank while its stages do not each fit 1/v of the device at their own peaks. Between the
    two caps the partitioner keeps the fastest cut (it took a slower one, or none, under the
    per-stage rule alone), and the plan's count of each rank (``_estimate``) is within the device."""
    units = _units(8)
    cfg = S.Config(tp=1, pp=2, dp=1, microbatch_size=1, microbatches=8, zero=0, recompute="none",
                   schedule="interleaved", virtual_stages=2)
    inflight = P._inflight("interleaved", 2, 8, 2)
    layers = P._Layers(units, "none")
    free = P._partition(units, cfg, cap=1e18, state_per_param=16, inflight=inflight, memo={})
    # the device each needs: per stage, v times the fullest stage at its own peak; jointly, the fullest rank
    per_stage = 2 * max(16 * (layers.pre_p[j] - layers.pre_p[i]) + inflight[s] * (layers.pre_a[j] - layers.pre_a[i])
                        for s, (i, j) in enumerate(free))
    cand = S._estimate(units, free, cfg, H100x2, "mixed", inflight)
    joint = max(sum(16 * (layers.pre_p[j] - layers.pre_p[i]) for i, j in free[r::2])
                + sum(st.activations_bytes for st in cand.stages[r::2]) for r in range(2))
    assert joint < 0.9 * per_stage, (joint, per_stage)  # the states differ enough to matter here
    device = (joint + per_stage) / 2
    rule = dict(cap=device / 2, state_per_param=16, inflight=inflight)
    assert not all(layers.fits(i, j, s, **rule) for s, (i, j) in enumerate(free))
    for memo in ({}, None):
        got = P._partition(units, cfg, **rule, memo=memo)
        assert got == list(free), (memo, got, free)
    # each rank counted as the plan counts it, with and without full recompute, uneven working sets
    uneven = [replace(u, transient_bytes=t * 1e7, act_bytes=u.act_bytes * a)
              for u, t, a in zip(units, (3, 9, 1, 4, 12, 2, 6, 5), (1, 2, 1, 3, 1, 1, 2, 1))]
    for recompute in ("none", "full"):
        c = replace(cfg, recompute=recompute)
        lay = P._Layers(uneven, recompute)
        est = S._estimate(uneven, free, c, H100x2, "mixed", inflight)
        need = max(sum(16 * (lay.pre_p[j] - lay.pre_p[i]) for i, j in free[r::2])
                   + sum(st.activations_bytes for st in est.stages[r::2]) for r in range(2))
        for scale, fits in ((1 + 1e-9, True), (1 - 1e-9, False)):
            assert P._ranks_fit(lay, free, c, cap=need * scale, state_per_param=16, buffers=(0.0, 0.0),
                                expert_per_param=0.0) is fits, (recompute, scale)
    # a pinned layout is judged the same way
    starts = tuple(i for i, _ in free[1:])
    assert P._partition(units, cfg, **rule, memo={}, starts=starts) == list(free)
    assert P._partition(units, cfg, cap=joint * (1 - 1e-9) / 2, state_per_param=16, inflight=inflight, memo={},
                        starts=starts) is None


def test_full_recompute_peaks_at_one_layers_backward():
    """Under full recompute a micro-batch in its backward holds what the layers before the one
    whose backward runs keep, that layer's copies and its largest op's working set; the other
    micro-batches in flight hold what every layer keeps. A program that re-runs each layer whole
    (torch checkpoint: ``whole_layer_remade``) keeps each layer's input and holds all of the
    running layer's activations again; autopar's runtime keeps what ``full_kept_bytes`` says and
    holds its copies at their peak (``remade_extra_bytes[3]``)."""
    from autopar.planner.bounds import stage_activation_bytes

    mb = 1e6
    units = [replace(u, act_bytes=act * mb, boundary_bytes=b * mb, full_kept_bytes=b * mb, transient_bytes=t * mb,
                     whole_layer_remade=True)
             for u, (act, b, t) in zip(_units(3), [(10, 1, 5), (4, 2, 1), (12, 3, 0)])]
    # layer 0: 10 + 5; layer 1: 1 + 4 + 1; layer 2: 1 + 2 + 12 + 0 -> 15 (not 12 + 6 + 5 = 23)
    assert stage_activation_bytes(units, "full", 1) == 15 * mb
    assert stage_activation_bytes(units, "full", 3) == (2 * 6 + 15) * mb
    assert stage_activation_bytes(units, "none", 2) == (2 * 26 + 5) * mb
    ours = [replace(u, whole_layer_remade=False, full_kept_bytes=k * mb, remade_extra_bytes=(0.0, 0.0, 0.0, x * mb))
            for u, (k, x) in zip(units, [(2, 3), (1, 6), (1, 4)])]
    # layer 0: 2 + 5 + 3 = 10; layer 1: 2 + 1 + 1 + 6 = 10; layer 2: 2 + 1 + 1 + 0 + 4 = 8
    assert stage_activation_bytes(ours, "full", 1) == 10 * mb
    assert stage_activation_bytes(ours, "full", 3) == (2 * 4 + 10) * mb
    assert stage_activation_bytes(ours, "none", 2) == (2 * 26 + 5) * mb  # (other policies as before)


def test_zero_bubble_stage_holds_weight_gradient_inputs_between_b_and_w():
    """Under a zero-bubble schedule a micro-batch between its B and its W holds what its weight
    gradients read, whatever the recompute policy: recompute does not shrink those micro-batches
    (ZB-H1's last stage under full recompute measured 3.1x the 1F1B-style count)."""
    from autopar.planner.bounds import stage_activation_bytes

    mb = 1e6
    # (full recompute re-runs each layer whole: torch checkpoint's count)
    units = [replace(u, act_bytes=act * mb, boundary_bytes=b * mb, full_kept_bytes=b * mb, transient_bytes=t * mb,
                     w_held_bytes=h * mb, whole_layer_remade=True)
             for u, (act, b, t, h) in zip(_units(3), [(10, 1, 5, 6), (4, 2, 1, 3), (12, 3, 0, 8)])]
    # ZB-H1, 2 stages, the last: (0 before B, 2 between B and W), or one in its B beside (0, 1)
    moments = P.zero_bubble_moments("zb-h1", 2, 4)[1]
    assert (0, 2) in moments[0] and moments[1] == ((0, 1),)
    # two micro-batches waiting for W: 2 x (6 + 3 + 8) + the largest op 5 = 39. One in its B beside
    # one waiting: 17 + max over k of (inputs kept before k + k's activations + k's op + W's inputs
    # after k): k=0: 0 + 10 + 5 + 11 = 26; k=1: 1 + 4 + 1 + 8 = 14; k=2: 3 + 12 + 0 = 15 -> 43
    assert stage_activation_bytes(units, "full", 2, moments) == 43 * mb
    # without recompute the fullest state is one micro-batch done with its forward (all 26 kept)
    # beside one waiting for W (17) while an op works (5); in its B it would hold 17 + 26 = 43
    assert stage_activation_bytes(units, "none", 2, moments) == 48 * mb
    # a unit with no count of its own holds its forward's activations between B and W
    assert stage_activation_bytes([replace(units[0], w_held_bytes=None)], "full", 2, (((0, 2),), ())) == 25 * mb


def test_zero_bubble_moments_are_the_full_lists():
    """The states read off the action lists at 3 x pp micro-batches are those of the whole lists
    (the first stage, whose B is empty, is counted as 1F1B's)."""
    from autopar.cost.schedule import make_schedule

    shapes = [(pp, m) for pp in range(1, 7) for m in range(1, 25)] + [(16, 47), (16, 49), (16, 60), (32, 97)]
    for kind in ("zb-h1", "zb-h2"):
        for pp, m in shapes:
            lists = make_schedule(kind, n_stages=pp, n_micro=m)
            full = P.moments_of(((a.stage, a.kind, a.microbatch) for acts in lists.values() for a in acts), pp)
            assert P.zero_bubble_moments(kind, pp, m) == (None,) + full[1:], (kind, pp, m)
    assert P.zero_bubble_moments("1f1b", 4, 8) is None


def _held_from_comm_lists(kind, pp, m, v):
    """held_messages read off the runtime's own lists (with_comm's strings, RECVs where they are
    posted): a second way to the same counts."""
    from autopar.cost.schedule import make_schedule, parse_action, with_comm

    n = pp * v
    lists = with_comm(make_schedule(kind, n_stages=pp, n_micro=m, n_virtual=v), n)
    out = []
    for r in range(pp):
        held, seen = [0] * v, set()
        for text in lists.get(r, ()):
            if "RECV_" in text:
                held[int(text.split("RECV_")[0]) // pp] += 1
            elif "SEND_" not in text:
                a = parse_action(text)
                held[a.stage // pp] -= a.stage > 0 if a.kind == "F" else a.kind in ("B", "BW") and a.stage < n - 1
                seen.add(tuple(held))
        out.append(tuple(sorted(c for c in seen if not any(d != c and all(x >= y for x, y in zip(d, c))
                                                          for d in seen))))
    return tuple(out)


def test_received_messages_held_match_the_runtime_lists():
    """A receive is posted at its peer's send and read by a later piece: what each stage holds
    received and unread, from the lists the runtime runs. Interleaved: exactly (read at 2 pp
    micro-batches); one stage per rank: by rule, never fewer than the lists, equal but for ZB-H2
    below 2 pp micro-batches."""
    from autopar.cost.schedule import make_schedule
    from autopar.planner.pipeline_states import messages_of

    for pp, v in [(2, 2), (3, 2), (4, 3), (4, 2)]:
        for m in range(pp, 6 * pp + 1, pp):
            full = _held_from_comm_lists("interleaved", pp, m, v)
            assert messages_of(make_schedule("interleaved", n_stages=pp, n_micro=m, n_virtual=v), pp, v) == full
            assert P.held_messages("interleaved", pp, m, v) == full, (pp, v, m)
    for kind in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        for pp in range(1, 7):
            for m in range(1, 4 * pp + 1):
                full = _held_from_comm_lists(kind, pp, m, 1)
                rule = P.held_messages(kind, pp, m)
                if kind == "zb-h2" and m < 2 * pp:
                    assert all(max(a)[0] >= max(b)[0] for a, b in zip(rule, full)), (kind, pp, m, rule, full)
                else:
                    assert rule == full, (kind, pp, m, rule, full)
    # 1F1B: a stage after the first holds the next micro-batch's input while its backward runs;
    # interleaved, 2 ranks x 2 stages, 4 micro-batches: rank 1's first stage holds 3 at once
    assert P.held_counts("1f1b", 4, 8) == (0, 1, 1, 1)
    assert P.held_counts("interleaved", 2, 4, 2) == (0, 3, 0, 2)


def test_interleaved_rank_holds_its_fullest_state_not_each_stages_peak():
    """An interleaved rank's stages peak at different moments: its activations are those of its
    fullest state, shared out to its stages, not each stage's own peak added up."""
    from autopar.cost.schedule import make_schedule
    from autopar.planner.bounds import rank_activation_shares, stage_activation_bytes

    for pp, v in [(2, 2), (3, 2), (4, 3), (4, 4)]:
        for m in range(pp, 6 * pp + 1, pp):
            full = P.states_of(make_schedule("interleaved", n_stages=pp, n_micro=m, n_virtual=v), pp, v)
            assert P.rank_states(pp, m, v) == full, (pp, v, m)
    # 2 ranks x 2 stages, 4 micro-batches: rank 0 holds 3 of stage 0 and 2 of stage 2, or 4 and 1,
    # never 4 and 2 (each stage's own peak)
    assert P._inflight("interleaved", 2, 4, 2)[0::2] == (4, 2)
    states = P.rank_states(2, 4, 2)[0]
    assert max(sum(c) for c, _ in states) == 5
    mb = 1e6
    units = [replace(u, act_bytes=a * mb, boundary_bytes=mb, transient_bytes=t * mb)
             for u, (a, t) in zip(_units(2), [(10, 2), (6, 3)])]
    shares = rank_activation_shares([units[:1], units[1:]], "none", states)
    # fullest: 4 x 10 + 1 x 6 + the rank's largest working set (stage 1's, 3) = 49; with 3 and 2 in
    # flight 3 x 10 + 2 x 6 + 3 = 45. Each stage's own peak, added: (4 x 10 + 2) + (2 x 6 + 3) = 57
    assert shares == [40 * mb, 9 * mb]
    own = stage_activation_bytes(units[:1], "none", 4) + stage_activation_bytes(units[1:], "none", 2)
    assert sum(shares) < own == 57 * mb


def test_partition_memory_rule_is_the_stages_estimate():
    """The partitioner's O(1) memory rule (prefix sums and range maxima) admits a stage exactly when
    its activations as the candidate's estimate counts them (bounds.stage_activation_bytes) fit,
    zero-bubble schedules' states included."""
    import random

    from autopar.planner.bounds import stage_activation_bytes

    rng = random.Random(5)
    units = [replace(u, act_bytes=rng.uniform(1, 9) * 1e8, cheap_act_bytes=rng.uniform(0, 1) * 1e8,
                     boundary_bytes=rng.uniform(0.1, 3) * 1e8, transient_bytes=rng.uniform(0, 4) * 1e8,
                     w_held_bytes=rng.uniform(0.5, 6) * 1e8)
             for u in _units(9)]
    zb = [P.zero_bubble_moments(kind, 4, 12)[s] for kind in ("zb-h1", "zb-h2") for s in (1, 3)]
    for recompute in ("none", "selective", "full"):
        layers = P._Layers(units, recompute)
        for inflight, moments in [(1, None), (3, None)] + [(4, m) for m in zb]:
            for i in range(len(units)):
                for j in range(i + 1, len(units) + 1):
                    need = stage_activation_bytes(units[i:j], recompute, inflight, moments)
                    rule = dict(state_per_param=0.0, inflight=(inflight,), moments=moments and (moments,))
                    assert layers.fits(i, j, 0, cap=need * (1 + 1e-9), **rule), (recompute, inflight, i, j)
                    assert not layers.fits(i, j, 0, cap=need * (1 - 1e-9), **rule), (recompute, inflight, i, j)


def test_cuts_reach_the_exhaustive_slowest_stage():
    """The partitioner's bisection (which jumps its ends to stage times the packing met) finds
    the slowest stage that enumerating every contiguous partition finds, under memory caps from
    roomy to infeasible, with uneven layers and ties."""
    import itertools
    import random

    rng = random.Random(11)
    for trial in range(40):
        n, pp = rng.randint(3, 9), rng.randint(2, 4)
        if pp > n:
            continue
        ties = trial % 3 == 0  # equal layers: many partitions share the optimum
        units = [replace(u, f_s=u.f_s * (1.0 if ties else rng.uniform(0.2, 3.0)),
                         act_bytes=u.act_bytes * rng.uniform(0.5, 2.0)) for u in _units(n)]
        cfg = S.Config(tp=1, pp=pp, dp=1, microbatch_size=1, microbatches=4, zero=0, recompute="none",
                       schedule="1f1b", virtual_stages=1)
        layers = P._Layers(units, "none")
        inflight = P._inflight("1f1b", pp, 4)
        per_layer = 16 * units[0].n_params + 4 * units[0].act_bytes
        for scale in (1e3, 3.0, 2.0, 1.2):
            rule = dict(cap=scale * per_layer, state_per_param=16, inflight=inflight)
            best = None
            for inner in itertools.combinations(range(1, n), pp - 1):
                ends = (0, *inner, n)
                cuts = list(zip(ends, ends[1:]))
                if all(layers.fits(i, j, k, **rule) for k, (i, j) in enumerate(cuts)):
                    slowest = max(layers.pre_t[j] - layers.pre_t[i] for i, j in cuts)
                    best = slowest if best is None else min(best, slowest)
            got = P._partition(units, cfg, **rule)
            assert (got is None) == (best is None), (trial, scale)
            if got is not None:
                assert len(got) == pp and got[0][0] == 0 and got[-1][1] == n
                assert all(layers.fits(i, j, k, **rule) for k, (i, j) in enumerate(got))
                assert max(layers.pre_t[j] - layers.pre_t[i] for i, j in got) == pytest.approx(best, rel=1e-9)


def test_range_max_equals_slices():
    import random

    rng = random.Random(3)
    for n in (1, 2, 5, 16, 37):
        values = [rng.random() for _ in range(n)]
        table = P._sparse_max(values)
        for i in range(n + 1):
            for j in range(i, n + 1):
                assert P._range_max(table, i, j) == max(values[i:j], default=0.0)


def test_interleaved_depth_is_searched():
    units = _units(24)
    ranked, _ = _search(units, fixed={"pp": 2, "schedule": "interleaved"}, keep=50, tp=(8,))
    assert {c.config.virtual_stages for c in ranked} == {2, 3, 4}
    for c in ranked:
        assert len(c.stages) == 2 * c.config.virtual_stages
    only3, _ = _search(units, fixed={"pp": 2, "schedule": "interleaved", "virtual_stages": 3}, tp=(8,))
    assert {c.config.virtual_stages for c in only3} == {3}


def test_dp_link_bound_is_a_lower_bound_and_binds_when_communication_dominates():
    """Large gradient buckets over a cross-node dp group, little compute: the dp collectives
    outlast the compute, so the link bound is above the compute-only bound, and still no
    higher than the simulated step for every ZeRO stage, schedule and chunk count."""
    cluster = parse_cluster("4x8xH100")
    units = _units(8, f_s=2e-4, params=1e9)
    ranked, _ = _search(units, cluster=cluster, fixed={"tp": 8}, batch=32, keep=10**9, tp=(8,))
    binds = set()
    for c in ranked:
        compute_only, with_link = S.lower_bound_s(c), S.lower_bound_s(c, cluster)
        assert with_link <= c.step_time_s * (1 + 1e-12), (c.config, with_link, c.step_time_s)
        if c.config.dp > 1 and with_link > compute_only * 1.01:
            binds.add((c.config.zero, c.config.virtual_stages > 1))
    assert {z for z, _ in binds} == {0, 1, 2, 3} and (True in {v for _, v in binds}), binds


def test_overlap_bound_is_a_lower_bound_and_binds_under_zero_3(monkeypatch):
    """Compute slows while collectives overlap it (cost.step.OVERLAP_SLOWDOWN): with dp
    collectives about as long as the compute, the bound that counts this slowdown stays below
    every simulated step (configuration bound before the cuts, cut bound, candidate bound),
    and for one stage per rank under ZeRO 3 it is sharper than the bound without it."""
    from autopar.planner import bounds as B

    cluster = parse_cluster("4x8xH100")
    units = _units(8, f_s=2e-3, params=4e8)
    ranked, _ = _search(units, cluster=cluster, fixed={"tp": 8}, batch=32, keep=10**9, tp=(8,))
    sharper = 0
    for c in ranked:
        cfg = c.config
        scaled = [replace(u, f_s=u.f_s * cfg.microbatch_size / 8, b_s=u.b_s * cfg.microbatch_size / 8,
                          w_s=u.w_s * cfg.microbatch_size / 8, n_params=u.n_params / 8) for u in units]
        link = cluster.link_for_group(cfg.dp, stride=cfg.tp)
        dp_s = S._dp_comm_prefix(scaled, zero=cfg.zero, dp=cfg.dp, link=link, microbatches=cfg.microbatches,
                                 precision="mixed")[-1]
        config_bound = S._config_bound_s(S._work_s(scaled, cfg.recompute), sum(u.n_params for u in scaled),
                                         zero=cfg.zero, m=cfg.microbatches, pp=cfg.pp, dp=cfg.dp, link=link,
                                         precision="mixed", cluster=cluster, dp_comm_s=dp_s,
                                         virtual_stages=cfg.virtual_stages)
        with_slowdown = S.lower_bound_s(c, cluster)
        assert config_bound <= c.step_time_s * (1 + 1e-12), (cfg, config_bound, c.step_time_s)
        assert with_slowdown <= c.step_time_s * (1 + 1e-12), (cfg, with_slowdown, c.step_time_s)
        with monkeypatch.context() as m:
            m.setattr(B, "OVERLAP_SLOWDOWN", 1.0)
            without = S.lower_bound_s(c, cluster)
        assert without <= with_slowdown
        if cfg.pp == 1 and cfg.zero == 3 and cfg.dp > 1:
            sharper += with_slowdown > without * 1.05
    assert sharper >= 2, sharper


def test_infeasible_message_counts_the_largest_op_and_names_it():
    # A stage cannot hold less than its biggest op's working set: an even split's need must
    # include it (it once reported 9 GB for a 405B plan at 128k tokens whose loss op alone
    # needed 101 GB), and the message says which op it is.
    from autopar.cluster import parse_cluster
    from autopar.planner.infeasible import _infeasible, _largest_op, _min_memory
    from autopar.planner.search import Config, Fixed, Unit

    def unit(path, transient):
        return Unit(path=path, f_s=1e-3, b_s=2e-3, w_s=1e-3, comm_s=0.0, cheap_f_s=0.0, act_bytes=1e9,
                    cheap_act_bytes=0.0, boundary_bytes=1e6, n_params=1e8, transient_bytes=transient)

    units = [unit(f"layers.{i}", 1e8) for i in range(4)] + [unit("<loss>", 100e9)]
    cfg = Config(tp=1, pp=2, dp=1, microbatch_size=1, microbatches=1, zero=0, recompute="none", schedule="gpipe")
    need = _min_memory(units, cfg, per_param=(16.0, 0.0), inflight=(1, 1))
    assert need >= 100e9
    cluster = parse_cluster("1x2xH100")
    err = _infeasible((need, cfg, _largest_op(units)), cluster, Fixed(), 0, 2, 2)
    assert "the largest single op (in <loss>) alone needs 100.0 GB" in str(err)
    small = _infeasible((need, cfg, ("layers.0", 1e8)), cluster, Fixed(), 0, 2, 2)
    assert "largest single op" not in str(small)  # said only where it decides


def test_infeasible_need_of_interleaved_counts_each_rank_jointly():
    # The 'smallest need' of an interleaved configuration is a rank's: its v stages' state and
    # activations at the rank's fullest state, the amount at which the partitioner's rank rule
    # (_ranks_fit) takes the same even cuts; for a pinned layout, the pinned stages by rank
    from autopar.planner.infeasible import _min_memory

    uneven = [replace(u, transient_bytes=t * 1e7, act_bytes=u.act_bytes * a)
              for u, t, a in zip(_units(8), (3, 9, 1, 4, 12, 2, 6, 5), (1, 2, 1, 3, 1, 1, 2, 1))]
    inflight = P._inflight("interleaved", 2, 8, 2)
    for recompute in ("none", "full"):
        cfg = S.Config(tp=1, pp=2, dp=1, microbatch_size=1, microbatches=8, zero=0, recompute=recompute,
                       schedule="interleaved", virtual_stages=2)
        lay = P._Layers(uneven, recompute)
        for starts, cuts in ((None, [(0, 2), (2, 4), (4, 6), (6, 8)]), ((1, 4, 7), [(0, 1), (1, 4), (4, 7), (7, 8)])):
            need = _min_memory(uneven, cfg, per_param=(16.0, 0.0), inflight=inflight, starts=starts)
            for scale, fits in ((1 + 1e-9, True), (1 - 1e-9, False)):
                assert P._ranks_fit(lay, cuts, cfg, cap=need * scale, state_per_param=16, buffers=(0.0, 0.0),
                                    expert_per_param=0.0) is fits, (recompute, starts, scale)
            # (not a stage alone: each rank holds two)
            alone = max(16 * (lay.pre_p[j] - lay.pre_p[i]) + (lay.pre_a[j] - lay.pre_a[i]) for i, j in cuts)
            assert need > alone


def test_inflight_forms_equal_the_action_lists():
    # _inflight answers every configuration without building its schedule; each form equals
    # the count read off the lists (interleaved: built at min(m, 2p) micro-batches)
    from autopar.cost.schedule import make_schedule
    from autopar.planner.pipeline_states import _inflight, inflight_of

    for kind in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        for p in range(1, 17):
            for m in range(1, 3 * p + 5):
                assert _inflight(kind, p, m) == inflight_of(make_schedule(kind, n_stages=p, n_micro=m), p), \
                    (kind, p, m)
    for p in range(2, 11):
        for v in (2, 3, 4):
            for m in range(p, 6 * p + 1, p):
                want = inflight_of(make_schedule("interleaved", n_stages=p, n_micro=m, n_virtual=v), p * v)
                assert _inflight("interleaved", p, m, v) == want, (p, m, v)


def test_sac_is_weighed_without_a_pipeline_only():
    """The search weighs recompute="sac" at pp = 1 and not under a pipeline (its memory there is
    not yet counted right: search.py's ``policies``); pinned, a pipelined plan may have it."""
    units = [replace(u, sac_f_s=u.f_s / 3, sac_act_bytes=u.act_bytes / 4) for u in _units(8)]
    flat, _ = _search(units, fixed={"pp": 1}, keep=10**9, tp=(1, 2))
    piped, _ = _search(units, fixed={"pp": 2}, keep=10**9, tp=(1, 2))
    assert "sac" in {c.config.recompute for c in flat}
    assert {c.config.recompute for c in piped} == {"none", "selective", "full"}
    pinned, _ = _search(units, fixed={"pp": 2, "recompute": "sac"}, tp=(1, 2))
    assert {c.config.recompute for c in pinned} == {"sac"}
