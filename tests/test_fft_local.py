"""The causal FFT path's local route (`ops/linear/fft/causal.py`: `LOCAL`, `local_on`,
`local_product`): each chunk's own pairs (key in the query's chunk, key position <= query
position) by `triton_tiled`'s kernels, the pairs across chunks by the blocked product.

The reference is Luo et al. 2021's sum (Eq. 10) in float64, written here from the formula with
no code from the path under test: query i sits at position `q_offset + i`, and

    num_i = Σ_{j <= q_offset+i} exp(b(j - q_offset - i)) (φq_i·φk_j) v_j,   den_i: v_j := 1,

`b(r)` read from the table at index `r + Lq - 1 + q_offset`, padding keys left out. The op
returns `num·exp(-log_scale)`: the quotient is compared as it is, num and den in true units.

The chunk is forced (`causal.causal_chunk` replaced: `chunk_on` still asks `causal.BLOCKED`),
since the plan never cuts a sequence this short. Without CUDA the kernels run under Triton's
interpreter (tests/conftest.py).
"""
from __future__ import annotations

import pytest
import torch

_CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from fastrpe._validate import FastRPEError  # noqa: E402
from fastrpe.ops.linear import triton_tiled as tt  # noqa: E402
from fastrpe.ops.linear.fft import causal, certify, kernelized_num_den_fft, plan  # noqa: E402
from fastrpe.ops.linear.naive import kernelized_num_den_naive  # noqa: E402
from fastrpe.ops.linear.triton_chunked import triton_unavailable_reason  # noqa: E402
from fastrpe.testing import assert_close, assert_lowp_close  # noqa: E402

DEV = torch.device("cuda" if _CUDA else "cpu")
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEV) is not None,
                                reason=str(triton_unavailable_reason(DEV)))
F64 = torch.float64


# ---- switches and spies --------------------------------------------------------------------------

@pytest.fixture
def route(monkeypatch):
    """`route(T, local="always")`: the blocked product wherever it may run, `causal.LOCAL` set to
    `local`, and the plan's chunk forced to T; returns the `local` flags `chunk_on` passed the plan."""
    def set_route(T: int, local: str = "always") -> list[bool]:
        asked: list[bool] = []

        def chunk(Lq, q_offset, leaf, shape, kernels=False, local=False):
            asked.append(local)
            return T

        monkeypatch.setattr(causal, "BLOCKED", "always")
        monkeypatch.setattr(causal, "LOCAL", local)
        monkeypatch.setattr(causal, "causal_chunk", chunk)
        return asked

    return set_route


@pytest.fixture
def local_calls(monkeypatch):
    """Every `causal.local_product` call's `(T, products)`, the call itself passed through."""
    calls: list[tuple[int, str]] = []
    real = causal.local_product

    def spy(phi_q, phi_k, vv, lc, scale, q_offset, T, products="ieee", into=None):
        calls.append((T, products))
        return real(phi_q, phi_k, vv, lc, scale, q_offset, T, products, into=into)

    monkeypatch.setattr(causal, "local_product", spy)
    return calls


@pytest.fixture
def untrusted(monkeypatch):
    """How many rows each call's certificate sent to the exact dense recomputation (which would
    hide an error of the route under test: the float64 cases must send none)."""
    counts: list[int] = []
    real = certify.untrusted_rows

    def spy(*args, **kwargs):
        bad = real(*args, **kwargs)
        counts.append(int(bad.sum()))
        return bad

    monkeypatch.setattr(certify, "untrusted_rows", spy)
    return counts


# ---- inputs, the reference, the op -----------------------------------------------------------------

def _inputs(B, H, Lq, Lk, F, Dv, q_offset, dtype=F64, seed=0, table=None):
    """`(φq, φk, v, log_coeff)` leaves drawn in float64 and cast (so a float64 reference of the
    cast values is exact); the table a gentle decay plus N(0, 0.5²) noise unless given."""
    g = torch.Generator().manual_seed(seed)
    pq = torch.rand(B, H, Lq, F, generator=g, dtype=F64)
    pk = torch.rand(B, H, Lk, F, generator=g, dtype=F64)
    v = torch.randn(B, H, Lk, Dv, generator=g, dtype=F64)
    if table is None:
        r = torch.arange(-(Lq - 1 + q_offset), Lk - q_offset, dtype=F64)
        table = -0.05 * r.abs() + 0.5 * torch.randn(H, Lq + Lk - 1, generator=g, dtype=F64)
    return [t.to(dtype).to(DEV).requires_grad_() for t in (pq, pk, v, table)]


def _reference(pq, pk, v, lc, q_offset, mask=None):
    """Eq. 10 in float64, true units: `(num [B, H, Lq, Dv], den [B, H, Lq])`."""
    pq, pk, v, lc = (t.to(F64) for t in (pq, pk, v, lc))
    Lq, Lk = pq.shape[2], pk.shape[2]
    i = torch.arange(Lq, device=lc.device)[:, None]
    j = torch.arange(Lk, device=lc.device)[None, :]
    b = lc[:, j - i + Lq - 1]  # (H, Lq, Lk): b(j - q_offset - i)
    b = b.masked_fill(j > q_offset + i, float("-inf"))  # causal: keys up to the query's own position
    w = torch.exp(b)[None]  # (1, H, Lq, Lk)
    if mask is not None:
        w = w.masked_fill(mask[:, None, None, :], 0.0)
    a = torch.einsum("bhif,bhjf->bhij", pq, pk) * w
    return a @ v, a.sum(-1)


def _fft(pq, pk, v, lc, q_offset, mask=None):
    """The op under test: `(quotient, num, den)`, num and den brought to true units (float64)."""
    num, den, s = kernelized_num_den_fft(pq, pk, v, lc, causal=True, q_offset=q_offset, key_padding_mask=mask)
    e = torch.exp(s.detach().to(F64))[None]  # (1, H, Lq)
    return num / den[..., None], num.to(F64) * e[..., None], den.to(F64) * e


def _quotient(num, den):
    return num / den[..., None]


def _grads(outs, wrt, seed=1):
    """Gradients of a fixed random combination of the outputs (quotient, num, den)."""
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.to(F64) * torch.randn(o.shape, generator=g, dtype=F64).to(o.device)).sum() for o in outs)
    return torch.autograd.grad(loss, wrt)


NAMES = ("phi_q", "phi_k", "v", "log_coeff")


def _check_against_reference(ins, q_offset, mask=None, dtype=F64):
    """The op's quotient, num, den and the four gradients against `_reference` (float64 leaves
    cloned from `ins`), within `dtype`'s tolerance."""
    ref_ins = [t.detach().to(F64).requires_grad_() for t in ins]
    num, den = _reference(*ref_ins, q_offset, mask)
    want = (_quotient(num, den), num, den)
    want_grads = _grads(want, ref_ins)
    got = _fft(*ins, q_offset, mask)
    got_grads = _grads(got, ins)
    for name, a, b in zip(("quotient", "num", "den"), got, want):
        assert_close(a, b, dtype=dtype, msg=name)
    for name, a, b in zip(NAMES, got_grads, want_grads):
        assert_close(a, b, dtype=dtype, msg=f"grad {name}")


# ---- 1. the local route against the formula ------------------------------------------------------

# (B, H, Lq, Lk, q_offset, F, Dv, T)
CASES = [
    (1, 1, 1, 1, 0, 4, 3, 16),  # one query, one key
    (1, 2, 37, 37, 0, 5, 3, 16),  # odd length, the last chunk short
    (1, 1, 63, 63, 0, 3, 2, 32),  # odd length, two chunks
    (2, 1, 37, 50, 13, 8, 3, 16),  # queries after 13 cached keys, q_offset + Lq == Lk
    (1, 2, 30, 47, 17, 3, 2, 8),  # the first query chunk starts mid-chunk (b0 = 2)
    (1, 2, 20, 50, 5, 4, 2, 16),  # the queries end before the keys do
    (1, 2, 63, 63, 0, 4, 5, 64),  # one chunk over every position: no blocked product
    (1, 1, 70, 70, 0, 4, 3, 16),  # many small chunks
    (2, 2, 40, 40, 0, 4, 3, 16),  # B = 2, H = 2
]


def _id(c):
    return "B{}-H{}-Lq{}-Lk{}-off{}-F{}-Dv{}-T{}".format(*c)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_the_local_route_gives_the_formula_and_its_gradients(case, route, local_calls, untrusted):
    B, H, Lq, Lk, off, F, Dv, T = case
    asked = route(T)
    ins = _inputs(B, H, Lq, Lk, F, Dv, off)
    _check_against_reference(ins, off)
    assert asked == [True]  # chunk_on weighed the tiled chunks
    assert local_calls == [(T, "ieee")]  # the chunks' own pairs went through the tiled kernels
    assert untrusted == [0]  # no row was recomputed densely behind the route's back


def test_the_local_route_leaves_padding_keys_out(route, local_calls, untrusted):
    B, H, L, F, Dv, T = 2, 2, 45, 4, 3, 16
    route(T)
    mask = torch.zeros(B, L, dtype=torch.bool, device=DEV)
    mask[0, 3:9] = True  # inside the first chunk
    mask[1, 30:] = True  # the end of the sequence, across a chunk boundary
    mask[1, 1] = True  # row 1 of batch 1 sees key 0 only
    ins = _inputs(B, H, L, L, F, Dv, 0, seed=3)
    _check_against_reference(ins, 0, mask)
    assert local_calls == [(T, "ieee")] and untrusted == [0]


def test_a_table_with_minus_infinity_near_the_diagonal(route, local_calls):
    """Offsets 0 and -1 at `-inf` for one head: its rows see nothing near themselves, and
    in chunks of 2 a row's chunk can then hold no finite coefficient at all (the tiled kernels'
    empty rows); the first row sees nothing anywhere (exactly 0 from the op)."""
    B, H, L, F, Dv, T = 1, 2, 24, 3, 2, 2
    route(T)
    pq, pk, v, lc = _inputs(B, H, L, L, F, Dv, 0, seed=5)
    with torch.no_grad():
        lc[0, L - 2: L] = float("-inf")  # head 0: offsets -1 and 0
    num, den, _ = kernelized_num_den_fft(pq, pk, v, lc, causal=True)
    assert (num[:, 0, 0] == 0).all() and (den[:, 0, 0] == 0).all()
    want_num, want_den = _reference(pq, pk, v, lc, 0)
    _, got_num, got_den = _fft(pq, pk, v, lc, 0)
    assert_close(got_num, want_num.detach(), msg="num")
    assert_close(got_den, want_den.detach(), msg="den")
    # the gradients of num and den (the quotient is 0/0 on head 0's first row)
    ref = [t.detach().requires_grad_() for t in (pq, pk, v, lc)]
    want_grads = _grads(_reference(*ref, 0), ref)
    got_grads = _grads(_fft(pq, pk, v, lc, 0)[1:], [pq, pk, v, lc])
    for name, a, b in zip(NAMES, got_grads, want_grads):
        assert torch.isfinite(a).all(), name
        assert_close(a, b, msg=f"grad {name}")
    assert len(local_calls) == 3


# ---- 2. queries past the keys keep the recursion ---------------------------------------------------

@pytest.mark.parametrize("case", [(2, 1, 37, 40, 13, 4, 3, 16), (1, 2, 5, 10, 20, 3, 2, 8)],
                         ids=["off13-Lq37-Lk40", "off20-Lq5-Lk10"])
def test_queries_past_the_keys_keep_the_recursion_and_stay_exact(case, route, local_calls, untrusted):
    B, H, Lq, Lk, off, F, Dv, T = case
    assert off + Lq > Lk
    asked = route(T)
    assert not causal.local_on(DEV, Lq, Lk, off)
    assert causal.local_on(DEV, Lq, off + Lq, off)  # the same queries with keys up to the last
    ins = _inputs(B, H, Lq, Lk, F, Dv, off, seed=7)
    _check_against_reference(ins, off)
    assert asked == [False] and local_calls == [] and untrusted == [0]


# ---- 3. the switch -----------------------------------------------------------------------------------

def test_never_gives_what_always_gives(route, local_calls):
    B, H, L, F, Dv, T = 1, 2, 70, 4, 3, 16
    ins = _inputs(B, H, L, L, F, Dv, 0, seed=11)
    got = {}
    for setting in ("always", "never"):
        route(T, setting)
        outs = _fft(*ins, 0)
        got[setting] = (*outs, *_grads(outs, ins))
    assert local_calls == [(T, "ieee")]  # "always" only
    for name, a, b in zip(("quotient", "num", "den") + NAMES, got["always"], got["never"]):
        assert_close(a, b, msg=name)


def test_a_bad_setting_is_a_one_line_error(route, local_calls):
    route(16, "sometimes")
    pq, pk, v, lc = _inputs(1, 1, 20, 20, 3, 2, 0)
    with pytest.raises(FastRPEError, match="LOCAL") as e:
        kernelized_num_den_fft(pq, pk, v, lc, causal=True)
    assert "\n" not in str(e.value) and "sometimes" in str(e.value)
    with pytest.raises(FastRPEError, match="LOCAL"):
        causal.local_on(DEV, 20, 20, 0)
    assert local_calls == []


def test_the_default_takes_the_route_on_cuda_only(monkeypatch):
    monkeypatch.setattr(causal, "LOCAL", "cuda")
    assert not causal.local_on(torch.device("cpu"), 64, 64, 0)
    monkeypatch.setattr(causal, "LOCAL", "never")
    assert not causal.local_on(DEV, 64, 64, 0)
    monkeypatch.setattr(causal, "LOCAL", "always")
    assert causal.local_on(DEV, 64, 64, 0) and causal.local_on(DEV, 1, 1, 0)
    assert not causal.local_on(DEV, 64, 64, 1)  # the last query one past the keys


def test_a_trained_table_under_deterministic_algorithms_keeps_the_recursion(route, local_calls, untrusted):
    """The tiled kernels add the table's gradient atomically (as `triton_blocked`'s correlations,
    which refuse it too): a table that takes a gradient under `use_deterministic_algorithms` keeps
    the recursion, exactly; a frozen one, or a call without grad, still takes the route."""
    B, H, L, F, Dv, T = 1, 2, 40, 4, 3, 16
    pq, pk, v, lc = _inputs(B, H, L, L, F, Dv, 0, seed=5)
    route(T)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not causal.local_on(DEV, L, L, 0, table_grad=True) and causal.local_on(DEV, L, L, 0)
        _check_against_reference((pq, pk, v, lc), 0)
        assert local_calls == []
        kernelized_num_den_fft(pq, pk, v, lc.detach(), causal=True)
        assert len(local_calls) == 1
    finally:
        torch.use_deterministic_algorithms(before)


# ---- 4. causality ------------------------------------------------------------------------------------

def test_no_later_key_reaches_an_earlier_query(route, local_calls):
    """Keys and values from position p + 1 = 41 on (mid-chunk: chunks of 16) changed by orders of
    magnitude: outputs of queries up to p come back bitwise the same, and so do their gradients
    with respect to every input up to p and the table; the later keys' and values' are exactly 0."""
    B, H, L, F, Dv, T, p = 1, 2, 70, 4, 3, 16, 40
    route(T)
    pq, pk, v, lc = (t.detach().float() for t in _inputs(B, H, L, L, F, Dv, 0, seed=13))
    pk2, v2 = pk.clone(), v.clone()
    pk2[:, :, p + 1:] *= 1e3
    v2[:, :, p + 1:] = 1e4 * torch.randn(v2[:, :, p + 1:].shape, generator=torch.Generator().manual_seed(2)).to(v2)
    got = []
    for keys, values in ((pk, v), (pk2, v2)):
        ins = [t.clone().requires_grad_() for t in (pq, keys, values, lc)]
        num, den, s = kernelized_num_den_fft(*ins, causal=True)
        early = (num[:, :, :p + 1], den[:, :, :p + 1], s[:, :p + 1])
        g = torch.randn(early[0].shape, generator=torch.Generator().manual_seed(3)).to(num)
        grads = torch.autograd.grad((_quotient(early[0], early[1]) * g).sum(), ins)
        got.append((early, num, grads))
    (early, num, grads), (early2, num2, grads2) = got
    for name, a, b in zip(("num", "den", "log_scale"), early, early2):
        assert torch.equal(a, b), name
    assert not torch.equal(num[:, :, p + 1:], num2[:, :, p + 1:])  # the change did reach the later rows
    for name, a, b in zip(NAMES[:3], grads, grads2):
        assert torch.equal(a[:, :, :p + 1], b[:, :, :p + 1]), name
    assert torch.equal(grads[3], grads2[3]), "log_coeff"
    for a in grads2[1:3]:
        assert (a[:, :, p + 1:] == 0).all() and (a[:, :, :p + 1] != 0).any()
    assert len(local_calls) == 2


# ---- 5. lower precision --------------------------------------------------------------------------------

def test_float32_is_within_float32s_tolerance_of_the_formula(route, local_calls):
    B, H, L, F, Dv, T = 1, 2, 70, 8, 5, 32
    route(T)
    ins = _inputs(B, H, L, L, F, Dv, 0, dtype=torch.float32, seed=17)
    _check_against_reference(ins, 0, dtype=torch.float32)
    assert local_calls == [(T, "ieee")]


def test_the_products_follow_the_inputs_dtype():
    assert causal.local_products(torch.bfloat16) == causal.LOCAL_PRODUCTS
    assert causal.local_products(torch.float16) == causal.LOCAL_PRODUCTS
    assert causal.local_products(torch.float32) == "ieee"
    assert causal.local_products(torch.float64) == "ieee"


#: 16-bit results are the float32 path's rounded once at the end: each entry within half an ulp of
#: its own value (2^-9 for bf16, 2^-12 for fp16) of the float32 result, which the bf16x3 products
#: (16 significant bits) leave within a few 2^-16 of its terms' magnitude. Gradients are summed from
#: the 16-bit upstream gradient (itself rounded), so they are bounded relative to the largest
#: entry, not each entry: 4 ulps of the entry plus 4 ulps of the tensor's largest.
ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _within_ulps(a, b, dtype, msg):
    a, b = a.detach().to(F64), b.detach().to(F64)
    bound = 4 * ULP[dtype] * (b.abs() + b.abs().max())
    worst = float(((a - b).abs() - bound).max())
    assert worst <= 0, f"{msg}: over the bound by {worst:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_inputs_take_bf16x3_products_and_stay_close(dtype, route, local_calls):
    B, H, L, F, Dv, T = 1, 2, 50, 8, 4, 16
    route(T)
    ins = _inputs(B, H, L, L, F, Dv, 0, dtype=dtype, seed=19)
    ref_ins = [t.detach().to(F64).requires_grad_() for t in ins]
    num, den = _reference(*ref_ins, 0)
    want = (_quotient(num, den), num, den)
    want_grads = _grads(want, ref_ins)
    num16, den16, s = kernelized_num_den_fft(*ins, causal=True)
    assert num16.dtype == den16.dtype == dtype
    e = torch.exp(s.to(F64))[None]
    got = (_quotient(num16.float(), den16.float()), num16.to(F64) * e[..., None], den16.to(F64) * e)
    got_grads = _grads(got, ins)
    naive = kernelized_num_den_naive(*(t.detach() for t in ins), causal=True)
    assert_lowp_close(got[0], _quotient(naive[0].float(), naive[1].float()), want[0], msg="quotient")
    for name, a, b in zip(("quotient", "num", "den") + NAMES, got + got_grads, want + want_grads):
        _within_ulps(a, b, dtype, name)
    assert local_calls == [(T, causal.LOCAL_PRODUCTS)]


# ---- 6. a table too wide for the weight table --------------------------------------------------------

def _fast_flags(monkeypatch):
    """Each `triton_tiled.exp_table` call's per-head flag: 1 where the head takes the table, 0
    where its span sends it to an exponential per pair."""
    flags: list[list[int]] = []
    real = tt.exp_table

    def spy(*args, **kwargs):
        e, top, fast = real(*args, **kwargs)
        flags.append(fast.tolist())
        return e, top, fast

    monkeypatch.setattr(tt, "exp_table", spy)
    return flags


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_a_table_wider_than_the_exp_tables_span_still_gives_the_formula(dtype, route, local_calls, monkeypatch):
    """Head 0 a steep slope (30 nats a position in float64, over 700 nats across a chunk of 32;
    1 nat in float32, over 20), head 1 N(0, 1) with one deep entry at the chunk's far edge (-750
    or -25): both heads span more than `EXP_TABLE_SPAN` and take the exponential per pair."""
    B, L, F, Dv, T = 1, 70, 4, 3, 32
    slope, deep = (30.0, -750.0) if dtype == torch.float64 else (1.0, -25.0)
    assert slope * (T - 1) > tt.EXP_TABLE_SPAN[dtype] and -deep > tt.EXP_TABLE_SPAN[dtype]
    r = torch.arange(-(L - 1), L, dtype=F64)
    table = torch.stack([slope * r.clamp_max(0), torch.randn(2 * L - 1, generator=torch.Generator().manual_seed(4),
                                                              dtype=F64)])
    table[1, L - 1 - (T - 1)] = deep  # offset -(T-1)
    route(T)
    flags = _fast_flags(monkeypatch)
    ins = _inputs(B, 2, L, L, F, Dv, 0, dtype=dtype, seed=23, table=table)
    _check_against_reference(ins, 0, dtype=dtype)
    assert local_calls == [(T, "ieee")]
    assert flags and all(f == [0, 0] for f in flags)


# ---- 7. the plan ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("Lq,q_offset", [(1, 0), (255, 1), (256, 0), (4096, 0), (5000, 3000), (1 << 20, 0)])
def test_local_chunk_choices(Lq, q_offset):
    end = q_offset + Lq
    got = plan.local_chunk_choices(Lq, q_offset)
    assert got == sorted(set(got)) and got[0] >= plan.LOCAL_MIN_CHUNK
    assert all(T & (T - 1) == 0 for T in got)  # powers of two
    assert all(-(-end // T) <= plan.BLOCKED_CHUNKS for T in got)
    assert got[-1] >= end and (len(got) == 1 or got[-2] < end)  # the last one covers every position
    # the first is the smallest power of two from LOCAL_MIN_CHUNK within BLOCKED_CHUNKS chunks
    assert got[0] == plan.LOCAL_MIN_CHUNK or -(-end // (got[0] // 2)) > plan.BLOCKED_CHUNKS


def test_causal_chunk_with_the_local_route():
    shape = plan.Shape(1, 8, 32, 64)
    leaf = plan.causal_leaf(1, 8)
    assert plan.causal_chunk(4096, 0, leaf, shape, local=True) == 4096  # one chunk: no blocked product
    assert plan.causal_chunk(4096, 0, leaf, shape) is None  # without it, the recursion
    for kernels in (False, True):
        T = plan.causal_chunk(1 << 20, 0, leaf, shape, kernels, local=True)
        assert T is None or (T in plan.local_chunk_choices(1 << 20, 0) and -(-(1 << 20) // T) <= plan.BLOCKED_CHUNKS)
    T = plan.causal_chunk(1 << 20, 0, leaf, shape, True, local=True)
    assert T is not None and (1 << 20) // T <= plan.BLOCKED_CHUNKS


def test_causal_levels_with_the_local_route():
    shape = plan.Shape(1, 8, 32, 64)
    leaf = plan.causal_leaf(1, 8)
    for end, q_offset in ((4096, 0), (3000, 1096), (300, 0)):
        T = plan.local_chunk_choices(end - q_offset, q_offset)[-1]  # one chunk over all
        for kernels in (False, True):
            assert plan.causal_levels(end - q_offset, q_offset, leaf, T, shape, kernels, True) == plan.local_levels(T, shape)
    # more than one chunk: the blocked product's levels come on top
    assert plan.causal_levels(4096, 0, leaf, 1024, shape, True, True) > plan.local_levels(1024, shape)
    # linear in T, in float32 levels' units (float64 levels move twice the bytes)
    one = plan.local_levels(256, shape)
    assert one > 0
    for k in (2, 4, 64):
        assert plan.local_levels(256 * k, shape) == pytest.approx(k * one, rel=1e-12)
    assert plan.local_levels(256, shape._replace(dtype=torch.float64)) == pytest.approx(one / 2, rel=1e-12)
