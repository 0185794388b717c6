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
    results = ring_runs(world)
    assert case in OP_CASES
    for rank, result in enumerate(results):
        errors = result["cases"][case]
        expected = {"out", "dq", "dk", "dv"}
        expected |= {"d_rel_k"} if "values only" not in case and "no tables" not in case else set()
        expected |= {"d_rel_v"} if "keys only" not in case and "no tables" not in case else set()
        assert set(errors) == expected, (case, errors)
        for what, err in errors.items():
            assert err <= EXACT, f"{case}, rank {rank} of {world}: {what} differs by {err:.3g}"


def test_ring_posts_transfers_before_computing_and_waits_after(ring_results):
    """Each step's k/v transfer is in flight during that step's compute: posted before it starts, completed
    after it ends (the benchmark measures the time this saves)."""
    world, results = ring_results
    for result in results:
        events = {(p, s, e): t for p, s, e, t in result["timeline"]}
        for phase in ("forward", "backward"):
            for step in range(world):
                t = [events[(phase, step, e)] for e in ("issue", "compute_start", "compute_end", "wait_end")]
                assert t == sorted(t), (phase, step, t)


def test_two_runs_agree_bit_for_bit(ring_results):
    _, results = ring_results
    assert all(result["deterministic"] for result in results)


def test_bad_calls_name_the_argument(ring_results):
    _, results = ring_results
    errors = results[0]["errors"]
    assert "backend must be 'auto' or one of" in errors["backend"] and "'dense'" in errors["backend"]
    assert "layout must be one of" in errors["layout"]
    assert "attn_mask of shape" in errors["mask"] and "(B, H, n, N)" in errors["mask"]


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
