"""Plans: a call that repeats an earlier one (a decoding step) skips validate and resolve; any difference in what
they read takes the full path, and a bad call raises what it always raised."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import relattn.functional as fn
from helpers import assert_close, attention_ref, require_backend
from helpers.bad_calls import CASES, KW_CASES, base
from relattn import backends, relative_attention
from relattn.backends import BACKENDS, Backend, Serves, native
from relattn.positions import LogBuckets, T5Buckets


@pytest.fixture
def validations(monkeypatch):
    """Counts the calls that take the full path (check_call): ``validations()`` is the count so far. Starts with no
    plans, so that what an earlier test left cannot serve this one's first call."""
    monkeypatch.setattr(fn, "_PLANS", {})
    count = [0]
    check_call = fn.check_call

    def counted(*args, **kwargs):
        count[0] += 1
        return check_call(*args, **kwargs)

    monkeypatch.setattr(fn, "check_call", counted)
    return lambda: count[0]


def _inputs(b=1, h=4, n=1, m=9, d=5, dv=3, hkv=None, rows=5, heads_table=False, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hkv = hkv or h
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    k, v = torch.randn(b, hkv, m, d, generator=g, dtype=dtype), torch.randn(b, hkv, m, dv, generator=g, dtype=dtype)
    shape = (h, rows) if heads_table else (rows,)
    return q, k, v, torch.randn(*shape, d, generator=g, dtype=dtype), torch.randn(*shape, dv, generator=g, dtype=dtype)


# One decoding loop per case: a query at a time against a growing cache, every step against the float64 oracle. The
# window narrows on the first steps (K > the offsets reached), so those take the full path; the rest hit the plan.
DECODE = {
    "shared tables": dict(),
    "per-head tables, causal": dict(heads_table=True, is_causal=True),
    "grouped heads, scale": dict(hkv=2, scale=0.3),
    "rel_q": dict(rel_q=True),
    "Transformer-XL biases": dict(biases=True),
    "scalar bias per head, causal": dict(rel_bias=(4, 5), is_causal=True),
    "shared scalar bias, blocked": dict(rel_bias=(5,), backend="blocked"),
    "3-D inputs": dict(three_d=True),
    "blocked": dict(backend="blocked"),
    "dense, two queries a step": dict(backend="dense", n=2),
}


@pytest.mark.parametrize("case", DECODE, ids=list(DECODE))
@torch.no_grad()
def test_decoding_steps_hit_the_plan_and_match_the_oracle(case, validations):
    opts = dict(DECODE[case])
    backend, n, three_d = opts.pop("backend", "auto"), opts.pop("n", 1), opts.pop("three_d", False)
    rel_q, biases, bias_shape = opts.pop("rel_q", False), opts.pop("biases", False), opts.pop("rel_bias", None)
    kk, steps = 2, 7
    q, k, v, rk, rv = _inputs(n=n * steps, m=n * steps, hkv=opts.pop("hkv", None),
                              heads_table=opts.pop("heads_table", False))
    extra = {}
    if rel_q:
        extra["rel_q"] = torch.randn_like(rk)
    if biases:
        extra.update(content_bias=torch.randn(4, 5, dtype=q.dtype), position_bias=torch.randn(4, 5, dtype=q.dtype))
    if bias_shape is not None:  # the scalar bias: a step that dropped it, or read it at other rows, fails the oracle
        extra["rel_bias"] = torch.randn(*bias_shape, dtype=q.dtype) * 2
    for step in range(steps):
        rows, keys = slice(step * n, (step + 1) * n), slice(0, (step + 1) * n)
        args = [q[:, :, rows], k[:, :, keys], v[:, :, keys]]
        if three_d:
            args = [t[0] for t in args]
        got = relative_attention(*args, rk, rv, max_relative_position=kk, query_offset=step * n, enable_gqa=True,
                                 backend=backend, **opts, **extra)
        want = attention_ref(q[:, :, rows], k[:, :, keys], v[:, :, keys], rk, rv, max_relative_position=kk,
                             query_offset=step * n, **opts, **extra)
        assert_close(got, want[0] if three_d else want, torch.float64, f"step {step}")
    # the full path while the window is wider than the offsets reached (K narrowed to 0, 1, ... up to kk), then plans
    narrowed = sum(1 for step in range(steps) if max(n - 1 + step * n, n - 1) < kk)
    assert validations() == narrowed + 1


# Decoding loops with a bucket map (its tables expanded per step for the step's offsets) and a mask whose values
# change every step: each step against the float64 oracle. The map's K grows with the offsets until it saturates
# (T5's max_distance, DeBERTa's buckets), each new K a new key; past it every step hits the plan.
MAP_DECODE = {
    "T5 buckets (causal), a bias per head, a float mask": dict(
        positions=T5Buckets(8, 12, bidirectional=False), tables=False, bias=(4, 8), mask="float"),
    "T5 buckets (bidirectional), tables and a shared bias, a bool mask per head, grouped heads": dict(
        positions=T5Buckets(8, 12), tables=True, bias=(8,), mask="bool", hkv=2),
    "LogBuckets, tables, rel_q, a float mask over the batch, causal": dict(
        positions=LogBuckets(3, 8, 10), tables=True, rel_q=True, mask="float", is_causal=True),
    "a clipped window, a bool mask, rel_bias, blocked": dict(
        positions=2, tables=True, bias=(5,), mask="bool", backend="blocked"),
}


@pytest.mark.parametrize("case", MAP_DECODE, ids=list(MAP_DECODE))
@torch.no_grad()
def test_decoding_steps_with_a_bucket_map_and_a_mask_hit_the_plan_and_match_the_oracle(case, validations):
    opts = dict(MAP_DECODE[case])
    positions, mask_kind, steps = opts.pop("positions"), opts.pop("mask"), 20
    rows = positions.rows if not isinstance(positions, int) else 2 * positions + 1
    q, k, v, rk, rv = _inputs(b=2, n=steps, m=steps, hkv=opts.pop("hkv", None), rows=rows)
    g = torch.Generator().manual_seed(1)
    extra = dict(is_causal=opts.pop("is_causal", False))
    if not opts.pop("tables"):
        rk = rv = None
    if opts.pop("rel_q", False):
        extra["rel_q"] = torch.randn(rows, 5, generator=g, dtype=q.dtype)
    if (bias := opts.pop("bias", None)) is not None:
        extra["rel_bias"] = torch.randn(*bias, generator=g, dtype=q.dtype) * 2
    backend = opts.pop("backend", "auto")
    assert not opts
    seen = []
    for step in range(steps):
        keys = slice(0, step + 1)
        if mask_kind == "float":  # (B, 1, 1, M): new values every step, a plan that kept a step's mask fails
            mask = torch.randn(2, 1, 1, step + 1, generator=g, dtype=q.dtype)
        else:  # (1, H, 1, M), the last key always allowed
            mask = torch.rand(1, 4, 1, step + 1, generator=g) > 0.4
            mask[..., -1] = True
        got = relative_attention(q[:, :, step:step + 1], k[:, :, keys], v[:, :, keys], rk, rv,
                                 max_relative_position=positions, attn_mask=mask, query_offset=step,
                                 enable_gqa=True, backend=backend, **extra)
        want = attention_ref(q[:, :, step:step + 1], k[:, :, keys], v[:, :, keys], rk, rv,
                             max_relative_position=positions, attn_mask=mask, query_offset=step, **extra)
        assert_close(got, want, torch.float64, f"step {step}")
        seen.append(validations())
    assert seen[-1] < steps // 2, seen  # most steps were planned
    assert seen[-1] == seen[-6], seen  # and the last ones all were


@pytest.mark.parametrize("backend", ["auto", "blocked"])
def test_a_planned_masked_call_with_dropout_and_a_bucket_map_draws_the_unplanned_calls_mask(backend, validations):
    """Dropout on a planned call (a T5 map, a bias, a float mask, grouped heads, causal): the same seed gives the
    unplanned call's output and gradients, and the plan was used."""
    q, k, v, _, _ = _inputs(b=2, n=6, m=9, hkv=2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    bias = torch.randn(4, 8, dtype=q.dtype).requires_grad_()
    kw = dict(max_relative_position=T5Buckets(8, 12, bidirectional=False), rel_bias=bias, is_causal=True,
              attn_mask=torch.randn(2, 1, 6, 9, dtype=q.dtype), dropout_p=0.3, query_offset=3, enable_gqa=True,
              backend=backend)

    def run():
        torch.manual_seed(7)
        out = relative_attention(q, k, v, **kw)
        return (out, *torch.autograd.grad(out.sum(), (q, k, v, bias)))

    run()
    planned = run()
    assert validations() == 1
    fn._PLANS.clear()
    for got, want in zip(planned, run(), strict=True):
        assert torch.equal(got, want)
    assert validations() == 2


def test_a_plan_with_a_mask_serves_no_call_whose_mask_differs_in_what_its_key_holds(validations):
    """A planned masked call: another mask of the same key (shape but the key length, dtype, device) is read as
    it is; a mask of another dtype, shape or map takes the full path; each gives its unplanned bits."""
    q, k, v, rk, rv = _inputs(m=9, rows=8)
    base_kw = dict(max_relative_position=T5Buckets(8, 12), query_offset=8)
    mask = torch.randn(1, 1, 1, 9, dtype=torch.float64)
    with torch.no_grad():
        relative_attention(q, k, v, rk, rv, attn_mask=mask, **base_kw)
        same_key = relative_attention(q, k, v, rk, rv, attn_mask=mask * 3, **base_kw)
    assert validations() == 1
    changes = {
        "mask dtype": dict(attn_mask=mask > 0),
        "mask over heads": dict(attn_mask=mask.expand(1, 4, 1, 9)),
        "mask broadcast over the keys": dict(attn_mask=mask[..., :1]),
        "mask requires grad": dict(attn_mask=mask.clone().requires_grad_()),
        "no mask": dict(attn_mask=None),
        "another map": dict(attn_mask=mask, max_relative_position=T5Buckets(8, 13)),
        "the causal map": dict(attn_mask=mask, max_relative_position=T5Buckets(8, 12, bidirectional=False)),
    }
    for name, change in changes.items():
        kw, before = {**base_kw, **change}, validations()
        with torch.no_grad():
            got = relative_attention(q, k, v, rk, rv, **kw)
        assert validations() == before + 1, f"{name}: a plan served a call it does not stand for"
        plans = dict(fn._PLANS)
        fn._PLANS.clear()
        with torch.no_grad():
            assert torch.equal(got, relative_attention(q, k, v, rk, rv, **kw)), name
        fn._PLANS.update(plans)
    fn._PLANS.clear()
    with torch.no_grad():
        assert torch.equal(same_key, relative_attention(q, k, v, rk, rv, attn_mask=mask * 3, **base_kw))


@pytest.mark.parametrize("keys", [40, 3], ids=["K as given", "K narrowed"])
@pytest.mark.parametrize("heads_table", [False, True], ids=["shared tables", "per-head tables"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_a_planned_call_gives_the_unplanned_calls_bits(keys, heads_table, dtype, validations):
    """The plan's kernel call (the user's tables as they are, or narrowed: slices of them) gives the bits of the
    validated call's."""
    q, k, v, rk, rv = _inputs(m=keys, rows=9, heads_table=heads_table, dtype=dtype)
    first = relative_attention(q, k, v, rk, rv, max_relative_position=4, query_offset=keys - 1)
    k2, v2 = torch.randn_like(k), torch.randn_like(v)
    planned = relative_attention(q, k2, v2, rk, rv, max_relative_position=4, query_offset=keys - 1)
    assert validations() == 1
    fn._PLANS.clear()
    assert torch.equal(planned, relative_attention(q, k2, v2, rk, rv, max_relative_position=4, query_offset=keys - 1))
    assert not torch.equal(first, planned)
    assert validations() == 2


def _changes():
    """Calls that each differ from the base call in one property a plan's key holds: (name, change), where change
    maps (args, kwargs) of the base call to the changed call's."""

    def tensor(i, f):
        return lambda a, kw: ([f(t) if j == i else t for j, t in enumerate(a)], kw)

    def option(**changed):
        return lambda a, kw: (a, {**kw, **changed})

    return {
        "dtype": lambda a, kw: ([t.float() for t in a], kw),
        "device": lambda a, kw: ([t.to("meta") for t in a], kw),
        "batch": lambda a, kw: ([t.expand(2, *t.shape[1:]) if t.dim() == 4 else t for t in a], kw),
        "heads of k, v": lambda a, kw: ([t[:, :2] if j in (1, 2) else t for j, t in enumerate(a)],
                                        {**kw, "enable_gqa": True}),
        "queries": tensor(0, lambda t: t.expand(-1, -1, 2, -1)),
        "head dim of v": lambda a, kw: ([t[..., :2] if j in (2, 4) else t for j, t in enumerate(a)], kw),
        "q requires grad": tensor(0, lambda t: t.clone().requires_grad_()),
        "rel_k requires grad": tensor(3, lambda t: t.clone().requires_grad_()),
        "rel_k per head": tensor(3, lambda t: t.expand(4, *t.shape)),
        "no rel_v": tensor(4, lambda t: None),
        "rel_q": option(rel_q=torch.zeros(5, 5, dtype=torch.float64)),
        "content_bias": option(content_bias=torch.zeros(4, 5, dtype=torch.float64)),
        "rel_bias": option(rel_bias=torch.zeros(5, dtype=torch.float64)),
        "attn_mask": option(attn_mask=torch.ones(1, 9, dtype=torch.bool)),
        "is_causal": option(is_causal=True),
        "window": lambda a, kw: ([t[:3] if j in (3, 4) else t for j, t in enumerate(a)],
                                 {**kw, "max_relative_position": 1}),
        "window as a pair": option(max_relative_position=(2, 2)),
        "beyond": option(beyond="zero"),
        "scale": option(scale=0.5),
        "enable_gqa": option(enable_gqa=True),
        "backend": option(backend="dense"),
        # two keys, the query at position 1: offsets -1 .. 0, so K = 2 is narrowed to 1 (M is not in the key, but
        # what it decides is)
        "narrowed window": lambda a, kw: ([t[:, :, :2] if j in (1, 2) else t for j, t in enumerate(a)],
                                          {**kw, "query_offset": 1}),
    }


CHANGES = _changes()


@pytest.mark.parametrize("name", CHANGES, ids=list(CHANGES))
def test_a_plan_serves_no_call_that_differs_in_what_its_key_holds(name, validations):
    """After a call has its plan (the second call hits it), a call differing in one keyed property takes the full
    path, and gives what it gives without plans; the base call hits its plan again."""
    args, kw = list(_inputs(rows=5)), dict(max_relative_position=2, query_offset=8)
    with torch.no_grad():
        relative_attention(*args, **kw)
        relative_attention(*args, **kw)
    assert validations() == 1
    changed_args, changed_kw = CHANGES[name](args, kw)
    with torch.no_grad():
        got = relative_attention(*changed_args, **changed_kw)
    assert validations() == 2, "a plan served a call it does not stand for"
    if got.device.type != "meta":
        fn._PLANS.clear()
        with torch.no_grad():
            assert torch.equal(got, relative_attention(*changed_args, **changed_kw))


def test_grad_mode_autocast_and_dispatch_modes_are_never_served_a_plan(validations):
    q, k, v, rk, rv = _inputs(rows=5, dtype=torch.float32)
    kw = dict(max_relative_position=2, query_offset=8)
    with torch.no_grad():
        relative_attention(q, k, v, rk, rv, **kw)
        relative_attention(q, k, v, rk, rv, **kw)
    assert validations() == 1
    relative_attention(q, k, v, rk, rv, **kw)  # grad mode on: its own plan
    assert validations() == 2
    for _ in range(2):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = relative_attention(q, k, v, rk, rv, **kw)
        assert out.dtype == torch.bfloat16
    assert validations() == 4  # no plan under autocast: every call validated (and cast)

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for _ in range(2):
        with torch.no_grad(), Passing():
            relative_attention(q, k, v, rk, rv, **kw)
    assert validations() == 6


def test_a_differentiated_plan_keeps_gradients(validations):
    q, k, v, rk, rv = (t.requires_grad_() for t in _inputs(m=6, rows=5))
    for _ in range(2):
        out = relative_attention(q, k, v, rk, rv, max_relative_position=2, query_offset=5, is_causal=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v, rk, rv))
    want = attention_ref(q, k, v, rk, rv, max_relative_position=2, query_offset=5, is_causal=True)
    for got, exp in zip(grads, torch.autograd.grad(want.sum(), (q, k, v, rk, rv)), strict=True):
        assert_close(got, exp, torch.float64)
    assert validations() == 1


def test_a_plan_gives_way_when_its_backend_goes(validations, monkeypatch):
    """A plan keeps its backend only while the registry holds that backend under its name (and the backend is as
    available as it was)."""
    require_backend("native")
    q, k, v, rk, rv = _inputs(rows=5)
    kw = dict(max_relative_position=2, query_offset=8)
    for backend in ("auto", "native"):
        for _ in range(2):
            relative_attention(q, k, v, rk, rv, backend=backend, **kw)
    assert validations() == 2
    gpu_only = Backend("native", native.BACKEND.run, Serves(devices=frozenset({"cuda"})), "serves no CPU call")
    monkeypatch.setitem(BACKENDS, "native", gpu_only)
    with pytest.raises(ValueError, match=r"backend 'native' cannot serve these inputs: device cpu \(serves cuda\)"):
        relative_attention(q, k, v, rk, rv, backend="native", **kw)
    seen = []
    resolve = fn.resolve
    monkeypatch.setattr(fn, "resolve", lambda name, call: seen.append(resolve(name, call)) or seen[-1])
    relative_attention(q, k, v, rk, rv, **kw)  # "auto" chooses again
    assert validations() == 4 and [b.name for b in seen] == ["dense"]
    relative_attention(q, k, v, rk, rv, **kw)
    monkeypatch.setattr(backends, "BACKENDS", {"blocked": BACKENDS["blocked"]})  # another registry altogether
    relative_attention(q, k, v, rk, rv, **kw)
    assert validations() == 5 and [b.name for b in seen] == ["dense", "blocked"]


# test_validation's bad calls, and some that differ from the good one only where a plan's key must look: v's head dim
# against rel_v's, v's keys against k's, and options equal to the good call's (0 == False) but of the wrong type
BAD = [(dict(over), {}, exc, match) for over, exc, match in CASES] + [({}, kw, exc, match) for kw, exc, match in
                                                                         KW_CASES] + [
    (dict(v=torch.randn(2, 3, 6, 4)), {}, ValueError, r"rel_v must be \(5, 4\) or \(3, 5, 4\).*got \(5, 7\)"),
    (dict(v=torch.randn(2, 3, 7, 7)), {}, ValueError, r"v must be \(B, H, M, Dv\) = \(2, 3, 6, Dv\)"),
    ({}, dict(is_causal=0), TypeError, r"is_causal must be a bool, got int"),
    ({}, dict(enable_gqa=0), TypeError, r"enable_gqa must be a bool, got int"),
    ({}, dict(query_offset=False), TypeError, r"query_offset must be an int, got bool"),
    ({}, dict(scale=True), TypeError, r"scale must be a float or None, got bool"),
]


@pytest.mark.parametrize(("over", "kw", "exc", "match"), BAD)
def test_a_bad_call_raises_as_ever_after_a_good_one_has_its_plan(over, kw, exc, match, validations):
    good = base()
    for _ in range(2):
        relative_attention(good["q"], good["k"], good["v"], good["rel_k"], good["rel_v"], max_relative_position=2)
    assert validations() == 1 and len(fn._PLANS) == 1
    t = base(**over)
    with pytest.raises(exc, match=match):
        relative_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], **{"max_relative_position": 2, **kw})


@pytest.mark.parametrize(("over", "exc", "match"), [case for case in KW_CASES if "attn_mask" in case[0]])
def test_a_bad_mask_raises_as_ever_after_a_masked_call_has_its_plan(over, exc, match, validations):
    good = base()
    for _ in range(2):
        relative_attention(good["q"], good["k"], good["v"], good["rel_k"], good["rel_v"], max_relative_position=2,
                           attn_mask=torch.ones(5, 6, dtype=torch.bool))
    assert validations() == 1 and len(fn._PLANS) == 1
    with pytest.raises(exc, match=match):
        relative_attention(good["q"], good["k"], good["v"], good["rel_k"], good["rel_v"], max_relative_position=2,
                           attn_mask=over["attn_mask"])


@pytest.mark.parametrize("heads_table", [False, True], ids=["shared tables", "per-head tables"])
@torch.no_grad()
def test_a_native_decoding_step_is_planned_as_one_kernel_call(heads_table, validations):
    """A float32 step on "native" keeps the kernel call itself as its plan (no wrapper, no StatsOps.run): the
    backend's ``run`` is its stats ops' run, whatever else it serves (its packed ops apart)."""
    require_backend("native")
    q, k, v, rk, rv = _inputs(m=12, rows=9, heads_table=heads_table, dtype=torch.float32)
    relative_attention(q, k, v, rk, rv, max_relative_position=4, query_offset=11)
    (plan,) = fn._PLANS.values()
    assert plan.backend is BACKENDS["native"] and plan.forward is not None
