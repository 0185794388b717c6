"""``relattn.distributed``: the context-parallel ring on 2 and 3 gloo processes against the single-process op.

One spawned group per world size runs every case (a spawn costs seconds); each case is then its own test here.
"""

from __future__ import annotations

import pytest
import torch
from _distributed import OP_CASES, cases_for, read, spawn

from helpers import require_backend
from relattn import distributed as cp

EXACT = 1e-10  # float64


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory):
    """world size -> every rank's results, one spawned group per world size, run when first asked for."""
    from _distributed import op_worker

    runs = {}

    def get(world: int) -> list:
        if world not in runs:
            require_backend("native")  # build the kernel once here, not in each spawned process
            out = tmp_path_factory.mktemp(f"ring{world}")
            spawn(op_worker, world, str(out))
            runs[world] = read(out, world)
        return runs[world]

    return get


@pytest.fixture(params=[2, 3], ids=["2 ranks", "3 ranks"])
def ring_results(request, ring_runs):
    return request.param, ring_runs(request.param)


@pytest.mark.parametrize(("world", "case"), [(w, c) for w in (2, 3) for c in cases_for(w)],
                         ids=[f"{w} ranks-{c}" for w in (2, 3) for c in cases_for(w)])
def test_ring_equals_single_process_op(ring_runs, world, case):
    """Each conformance case (features combined pairwise, the scalar bias rel_bias among them, with T5's buckets; a
    fully masked row met by several chunk pairs among them) gives the single-process op's output and every gradient
    on every rank."""
    from helpers import TABLES

    results = ring_runs(world)
    c = OP_CASES[case]
    (has_k, _), (has_v, _) = TABLES[c["tables"]]
    present = {"d_rel_k": has_k, "d_rel_v": has_v, "d_rel_q": c["rel_q"] is not None,
               "d_rel_bias": c["rel_bias"] is not None}
    expected = {"out", "dq", "dk", "dv"} | {name for name, given in present.items() if given}
    for rank, result in enumerate(results):
        errors = result["cases"][case]
        assert set(errors) == expected, (case, errors)
        for what, err in errors.items():
            assert err <= EXACT, f"{case}, rank {rank} of {world}: {what} differs by {err:.3g}"


def test_every_keyword_of_the_op_is_served_or_refused(ring_runs):
    """The ring takes the op's whole argument set: each keyword of ``relative_attention`` (walked from its
    signature) either gives the op's result or is refused with a message naming it."""
    for rank, result in enumerate(ring_runs(2)):
        for name, (kind, got) in result["walk"].items():
            assert kind != "unknown", f"the op's keyword {name!r} is neither served nor refused by the ring"
            if kind == "served":
                assert got <= EXACT, f"rank {rank}: {name} differs from the op by {got:.3g}"
            else:
                assert got is not None and name.split("_")[0] in got, f"rank {rank}: {name} refused as {got!r}"


def test_the_module_runs_its_own_forward_under_context_parallelism(ring_runs):
    """``RelativeMultiheadAttention(...)(x, context_parallel=cp)``: the module's options (rel_q, rel_bias, grouped
    heads, LogBuckets, per-head and tied tables, asymmetric windows, Transformer-XL's projected table and biases,
    padding, causal) as in one process."""
    for rank, result in enumerate(ring_runs(2)):
        for config, errors in result["modules"].items():
            assert {"out", "q_proj.weight"} <= set(errors) and ({"rel_k"} & set(errors) or "pos_proj.weight" in errors)
            for what, err in errors.items():
                assert err <= EXACT, f"rank {rank}, {config}: {what} differs by {err:.3g}"


def test_each_step_computes_while_its_transfers_are_in_flight(ring_results):
    """At the start of each step's compute its k/v (and gradient) transfers are posted and not yet waited for:
    fails if a transfer is posted after the compute or waited for before it."""
    world, results = ring_results
    for result in results:
        events = {(p, s, e): t for p, s, e, t in result["timeline"]}
        for phase in ("forward", "backward"):
            for step in range(world - (phase == "forward")):  # the forward's last step has nothing to send
                assert (phase, step, "in_flight") in events, (phase, step)
                assert events[(phase, step, "issue")] <= events[(phase, step, "in_flight")] <= \
                    events[(phase, step, "compute_end")] <= events[(phase, step, "wait_end")]


def test_two_runs_agree_bit_for_bit(ring_results):
    _, results = ring_results
    assert all(result["deterministic"] for result in results)


def test_bad_calls_raise_on_every_rank_naming_the_argument(ring_results):
    world, results = ring_results
    for rank, result in enumerate(results):
        errors = result["errors"]
        assert "backend 'dense' cannot serve" in errors["backend"] and "chunk pair" in errors["backend"]
        assert "layout must be one of" in errors["layout"]
        assert "attn_mask of shape" in errors["mask"], errors["mask"]
        assert "same local shapes" in errors["lengths"] and "rank 0: (5," in errors["lengths"]
        assert ("rel_k must be" if rank == 1 else "rank(s) [1]") in errors["one rank refuses"]
        assert "attn_mask" in errors["mask grad"] and "grad" in errors["mask grad"]


def test_needs_a_process_group():
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cp.context_parallel_attention(q, q, q, max_relative_position=2)


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_layouts_partition_the_sequence(layout, world):
    n = 4
    parts = [cp.positions(n, r, world, layout) for r in range(world)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(n * world))
    x = torch.arange(n * world).repeat(2, 1)
    for r in range(world):
        assert torch.equal(cp.shard(x, r, world, dim=1, layout=layout)[0], parts[r])
    if layout == "zigzag":  # under causality every rank meets the same number of (query, key) pairs
        pairs = [sum(int(p) + 1 for p in part) for part in parts]
        assert len(set(pairs)) == 1, pairs


def test_shard_refuses_a_length_the_layout_cannot_split():
    with pytest.raises(ValueError, match="multiple of 4"):
        cp.shard(torch.zeros(1, 6), 0, 2, dim=1, layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.segments(4, 0, 2, "spiral")
