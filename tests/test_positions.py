"""Positional terms `b_h(r)`, r = key position − query position.

Checked against plain Python: every entry of `materialize` equals the family formula
(computed entry by entry with `math`), and it is Toeplitz; `log_coefficients` with a
query offset indexes the same values; T5 buckets equal HF's `_relative_position_bucket`
and hand-computed values; ALiBi slopes equal the official sequences; KERPLE constraints
survive absurd SGD steps; gradients pass `gradcheck`; `score_mod` run through
FlexAttention equals softmax with the materialized bias.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from fastrpe import positions as P
from fastrpe.testing import assert_close

H = 3

# ---------------------------------------------------------------------------
# families and their plain-Python formulas


def _build(name: str, num_heads: int = H):
    """A term with parameters moved away from their (often symmetric) init."""
    builders = {
        "learned": lambda: P.LearnedTable(num_heads, max_distance=20),
        "learned_causal": lambda: P.LearnedTable(num_heads, max_distance=20, causal=True),
        "t5": lambda: P.T5Bias(num_heads, num_buckets=16, max_distance=40),
        "t5_causal": lambda: P.T5Bias(num_heads, num_buckets=16, max_distance=40, bidirectional=False),
        "alibi": lambda: P.ALiBi(num_heads),
        "kerple_power": lambda: P.KerplePower(num_heads),
        "kerple_power_fixed_p": lambda: P.KerplePower(num_heads, p=2.0, learn_p=False),
        "kerple_log": lambda: P.KerpleLog(num_heads),
        "kerple_log3": lambda: P.KerpleLog3(num_heads),
        "kerple_bias_weight": lambda: P.KerpleBiasWeight(num_heads),
        "geometric": lambda: P.GeometricDecay(num_heads, gamma=[1.0, 0.9999, 0.5, 0.9][:num_heads]),
        "geometric_learned": lambda: P.GeometricDecay(num_heads, gamma=[0.999, 0.5, 0.9, 0.99][:num_heads],
                                                      learnable=True),
    }
    pos = builders[name]()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for prm in pos.parameters():
            prm.add_(0.5 * torch.randn(prm.shape, generator=g))
    return pos


FAMILIES = ["learned", "learned_causal", "t5", "t5_causal", "alibi", "kerple_power", "kerple_power_fixed_p",
            "kerple_log", "kerple_log3", "kerple_bias_weight", "geometric", "geometric_learned"]
LEARNABLE = [f for f in FAMILIES if f not in ("alibi", "geometric")]
KERPLE = ["kerple_power", "kerple_log", "kerple_log3", "kerple_bias_weight"]


def _floats(t: torch.Tensor) -> list[float]:
    return [float(x) for x in t.detach().double().flatten()]


def _formula(pos) -> Callable[[int, int], float]:
    """`f(h, r) -> float`: the family's formula in plain Python, from the mapped parameters."""
    if isinstance(pos, P.ALiBi):
        m = _floats(pos.slopes)
        return lambda h, r: -m[h] * abs(r)
    if isinstance(pos, P.GeometricDecay):  # c = γ^|r|
        gam = _floats(pos.gamma.double())
        return lambda h, r: abs(r) * math.log(gam[h]) if gam[h] < 1 else 0.0
    if isinstance(pos, P.KerplePower):
        r1, p = _floats(pos.r1), _floats(pos.p)
        return lambda h, r: -r1[h] * abs(r) ** p[h]
    if isinstance(pos, P.KerpleLog):
        r1, r2 = _floats(pos.r1), _floats(pos.r2)
        return lambda h, r: -r1[h] * math.log(1 + r2[h] * abs(r))
    if isinstance(pos, P.KerpleLog3):
        r1, r2, p = _floats(pos.r1), _floats(pos.r2), _floats(pos.p)
        return lambda h, r: -r1[h] * math.log(1 + r2[h] * abs(r) ** p[h])
    if isinstance(pos, P.KerpleBiasWeight):
        r1, r2 = _floats(pos.r1), _floats(pos.r2)
        return lambda h, r: -r1[h] * abs(r) ** r2[h]
    if isinstance(pos, P.LearnedTable):
        tab, k = pos.table.detach().double().tolist(), pos.max_distance
        hi = 0 if pos.causal else k
        return lambda h, r: tab[h][min(max(r, -k), hi) + k]
    if isinstance(pos, P.T5Bias):
        emb = pos.embedding.detach().double().tolist()
        return lambda h, r: emb[_hf_bucket_scalar(r, pos.bidirectional, pos.num_buckets, pos.max_distance)][h]
    raise TypeError(type(pos))


def _hf_bucket_scalar(relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """HF T5's `_relative_position_bucket`, line by line, on one Python int
    (`relative_position = memory_position - query_position`)."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0) * num_buckets
        relative_position = abs(relative_position)
    else:
        relative_position = -min(relative_position, 0)
    max_exact = num_buckets // 2
    if relative_position < max_exact:
        return relative_buckets + relative_position
    if_large = max_exact + int(
        math.log(relative_position / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return relative_buckets + min(if_large, num_buckets - 1)


def _hf_bucket_torch(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int):
    """HF T5's `_relative_position_bucket` as HF writes it in torch (float32 log included)."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
    )
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


# ---------------------------------------------------------------------------
# materialize / log_coefficients against the formula

SHAPES = [(1, 1, 0), (1, 63, 62), (5, 9, 0), (9, 5, 0), (7, 7, 3), (63, 100, 0), (100, 63, 0), (63, 100, 37)]
SHAPE_IDS = [f"Lq{a}-Lk{b}-off{c}" for a, b, c in SHAPES]


def _check_materialize(pos, Lq, Lk, off):
    M = pos.materialize(Lq, Lk, q_offset=off).detach()
    Hn = pos.num_heads
    assert M.shape == (Hn, Lq, Lk)
    assert torch.equal(M[:, 1:, 1:], M[:, :-1, :-1]), "not Toeplitz"
    f = _formula(pos)
    want = torch.tensor([[[f(h, j - (i + off)) for j in range(Lk)] for i in range(Lq)] for h in range(Hn)],
                        dtype=torch.float64)
    assert_close(M.double(), want, torch.float32)


@pytest.mark.parametrize("Lq,Lk,off", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_materialize_equals_formula_and_is_toeplitz(family, Lq, Lk, off):
    _check_materialize(_build(family), Lq, Lk, off)


@pytest.mark.parametrize("num_heads", [5, 6, 12], ids=lambda n: f"H{n}")
def test_alibi_materialize_awkward_heads(num_heads):
    _check_materialize(P.ALiBi(num_heads), 9, 14, 2)


@pytest.mark.parametrize("Lq,Lk,off", [(1, 1, 0), (6, 9, 2), (63, 100, 37), (1, 100, 99)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("family", FAMILIES)
def test_log_coefficients_with_q_offset_match_materialize(family, Lq, Lk, off):
    pos = _build(family)
    lc = pos.log_coefficients(Lq, Lk, off).detach()
    assert lc.shape == (H, Lq + Lk - 1)
    # entry t holds r = t - (Lq - 1 + off)
    f = _formula(pos)
    want = torch.tensor([[f(h, t - (Lq - 1 + off)) for t in range(Lq + Lk - 1)] for h in range(H)], dtype=torch.float64)
    assert_close(lc.double(), want, torch.float32)
    # materialize[h, i, j] = lc[h, j - i + Lq - 1]
    M = pos.materialize(Lq, Lk, off).detach()
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    assert torch.equal(M, lc[:, j - i + Lq - 1])
    # queries at off..off+Lq-1 are the last Lq rows of the same term without an offset
    assert torch.equal(M, pos.materialize(Lq + off, Lk, 0).detach()[:, off:])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_bias_has_the_parameter_dtype(family, dtype):
    pos = _build(family).to(dtype)
    assert pos.log_coefficients(4, 6, 1).dtype == dtype
    assert pos.materialize(4, 6, 1).dtype == dtype


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_term_computes_its_offsets_in_float32(family):
    """A term cast to bf16 with its model (parameters rounded) must not round the offsets:
    bf16 holds integers exactly only up to 256, and ALiBi's `-m·|r|` at r = 65,536 was off by
    tens of nats (issue 12's decoding at 64k). Reference: the same rounded parameters, float64."""
    pos16 = _build(family).to(torch.bfloat16)
    ref = _build(family).to(torch.bfloat16).to(torch.float64).log_coefficients(1, 70_001, 0).detach()
    got = pos16.log_coefficients(1, 70_001, 0).detach()
    assert got.dtype in (torch.bfloat16, torch.float32)  # tables stay bf16 (lookups), formulas float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# T5 buckets

T5_CONFIGS = [(32, 128), (16, 64), (8, 20), (64, 256), (10, 50), (6, 1000), (32, 17)]


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidir", "causal"])
@pytest.mark.parametrize("nb,md", T5_CONFIGS, ids=[f"nb{a}-md{b}" for a, b in T5_CONFIGS])
def test_t5_buckets_match_hf(bidirectional, nb, md):
    r = torch.arange(-3000, 3001)
    got = P.t5_bucket(r, bidirectional, nb, md)
    assert got.dtype == torch.int64
    assert torch.equal(got, _hf_bucket_torch(r, bidirectional, nb, md))
    scalar = torch.tensor([_hf_bucket_scalar(int(x), bidirectional, nb, md) for x in r])
    assert torch.equal(got, scalar)
    assert int(got.min()) >= 0 and int(got.max()) <= nb - 1


def test_t5_known_values():
    # HF defaults (32 buckets, max distance 128); r = key - query. Bidirectional: 16 buckets per
    # sign, 8 exact; bucket(n >= 8) = 8 + floor(log(n/8) / log(16) * 8) (bucket 9 starts at 8·16^(1/8) ≈ 11.3).
    b = lambda r: int(P.t5_bucket(torch.tensor(r), True, 32, 128))
    assert [b(0), b(-1), b(-7), b(-8), b(-11), b(-12), b(-16), b(-32), b(-64), b(-127), b(-1000)] == \
           [0, 1, 7, 8, 8, 9, 10, 12, 14, 15, 15]
    assert [b(1), b(7), b(8), b(12), b(1000)] == [17, 23, 24, 25, 31]
    # causal: 32 buckets for r <= 0, 16 exact; bucket(n >= 16) = 16 + floor(log(n/16) / log(8) * 16)
    c = lambda r: int(P.t5_bucket(torch.tensor(r), False, 32, 128))
    # (bucket 17 starts at n = 16·8^(1/16) ≈ 18.2)
    assert [c(0), c(-1), c(-15), c(-16), c(-18), c(-19), c(-32), c(-64), c(-127), c(-128), c(-1000)] == \
           [0, 1, 15, 16, 16, 17, 21, 26, 31, 31, 31]
    assert [c(1), c(5), c(10_000)] == [0, 0, 0]  # the future shares bucket 0


def test_t5_bias_reads_embedding_by_bucket():
    pos = _build("t5")
    r = torch.arange(-50, 50)  # Lq=51, Lk=50: offsets -50..49
    want = pos.embedding[P.t5_bucket(r, True, 16, 40)].T  # [H, 2L-1]
    assert torch.equal(pos.log_coefficients(51, 50).detach(), want.detach())
    assert pos.embedding.shape == (16, H)


def test_t5_refuses_degenerate_buckets():
    with pytest.raises(ValueError, match="T5Bias"):
        P.T5Bias(2, num_buckets=2)
    with pytest.raises(ValueError, match="T5Bias"):
        P.T5Bias(2, num_buckets=32, max_distance=8)  # max_distance must exceed max_exact (8)


# ---------------------------------------------------------------------------
# ALiBi slopes


def test_alibi_slopes_official_sequences():
    assert P.alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    assert P.alibi_slopes(16) == pytest.approx([2 ** (-(i + 1) / 2) for i in range(16)])
    assert P.alibi_slopes(1) == [2.0 ** -8]
    # 6 = 4 + 2: the 4-head slopes 1/4 .. 1/256, then every other 8-head slope
    assert P.alibi_slopes(6) == [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    assert P.alibi_slopes(5) == [0.25, 0.0625, 0.015625, 0.00390625, 0.5]
    # 12 = 8 + 4: 1/2 .. 1/256, then the 16-head slopes 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    s12 = P.alibi_slopes(12)
    assert s12[:8] == [2.0 ** -(i + 1) for i in range(8)]
    assert s12[8:] == pytest.approx([2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5], rel=1e-15)


@pytest.mark.parametrize("num_heads", [5, 6, 8, 12], ids=lambda n: f"H{n}")
def test_alibi_is_a_fixed_buffer(num_heads):
    pos = P.ALiBi(num_heads)
    assert list(pos.parameters()) == []
    assert "slopes" in dict(pos.named_buffers())
    assert_close(pos.slopes.double(), torch.tensor(P.alibi_slopes(num_heads), dtype=torch.float64), torch.float32)
    assert pos.double().slopes.dtype == torch.float64


# ---------------------------------------------------------------------------
# learned table


def test_learned_table_clips_and_causal_halves():
    full = P.LearnedTable(2, max_distance=4)
    causal = P.LearnedTable(2, max_distance=4, causal=True)
    assert full.table.shape == (2, 9) and causal.table.shape == (2, 5)
    with torch.no_grad():
        full.table.copy_(torch.arange(9.0).expand(2, -1))
        causal.table.copy_(torch.arange(5.0).expand(2, -1))
    r = torch.tensor([-100, -5, -4, -1, 0, 1, 4, 5, 100])
    h = torch.zeros_like(r)
    assert full.bias(h, r).tolist() == [0, 0, 0, 3, 4, 5, 8, 8, 8]
    assert causal.bias(h, r).tolist() == [0, 0, 0, 3, 4, 4, 4, 4, 4]


# ---------------------------------------------------------------------------
# KERPLE: constraints, init, gradients


def _constrained(pos) -> dict[str, str]:
    """Attribute -> "positive" (r > 0) or "exponent" (0 < p <= 2)."""
    if isinstance(pos, P.KerplePower):
        return {"r1": "positive", "p": "exponent"}
    if isinstance(pos, P.KerpleLog):
        return {"r1": "positive", "r2": "positive"}
    if isinstance(pos, P.KerpleLog3):
        return {"r1": "positive", "r2": "positive", "p": "exponent"}
    return {"r1": "positive", "r2": "exponent", "r3": "positive", "r4": "exponent"}


@pytest.mark.parametrize("lr", [1e2, 1e6], ids=lambda x: f"lr{x:g}")
@pytest.mark.parametrize("family", KERPLE)
def test_kerple_constraints_survive_huge_sgd_steps(family, lr):
    pos = _build(family)
    opt = torch.optim.SGD(pos.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        opt.zero_grad()
        M = pos.materialize(20, 20)
        loss = (torch.randn(M.shape, generator=g) * M).sum()
        if pos.weight is not None:
            loss = loss + (torch.randn(M.shape, generator=g) * pos.materialize_weight(20, 20)).sum()
        loss.backward()
        opt.step()
        for attr, kind in _constrained(pos).items():
            v = getattr(pos, attr)
            ok = (v > 0) & (v.isfinite() if kind == "positive" else v <= 2)  # float32 sigmoid can round to p = 2
            assert bool(ok.all()), (step, attr, v)
        assert torch.isfinite(pos.materialize(20, 20)).all()
        assert (pos.materialize(20, 20) <= 0).all()  # -kernel distances: never above b(0) = 0


def test_kerple_defaults_and_initial_values():
    # defaults: the means of the official uniform initializations
    assert_close(P.KerpleLog(2).r1, torch.ones(2))
    assert_close(P.KerpleLog(2).r2, torch.full((2,), 0.5))
    assert_close(P.KerplePower(2).r1, torch.full((2,), 0.5))
    assert_close(P.KerplePower(2).p, torch.ones(2))
    # per-head initial values round-trip through the reparameterization
    pos = P.KerpleLog3(3, r1=[0.5, 1.5, 3.0], r2=torch.tensor([0.1, 1.0, 2.0]), p=[0.3, 1.0, 1.9])
    assert_close(pos.r1, torch.tensor([0.5, 1.5, 3.0]))
    assert_close(pos.r2, torch.tensor([0.1, 1.0, 2.0]))
    assert_close(pos.p, torch.tensor([0.3, 1.0, 1.9]))
    bw = P.KerpleBiasWeight(2, r1=0.2, r2=1.5, r3=0.05, r4=0.7)
    assert_close(torch.stack([bw.r1, bw.r2, bw.r3, bw.r4]), torch.tensor([0.2, 1.5, 0.05, 0.7])[:, None].expand(4, 2))
    rnd = P.KerpleLog(4, r1=2 * torch.rand(4) + 0.02)  # the official random init
    assert rnd.raw_r1.shape == (4,)
    with pytest.raises(ValueError, match="exponents"):
        P.KerplePower(2, p=2.0)  # a learned p stays strictly below 2
    with pytest.raises(ValueError, match="coefficients"):
        P.KerpleLog(2, r2=0.0)
    with pytest.raises(ValueError, match="initial values"):
        P.KerpleLog(2, r1=[1.0, 2.0, 3.0])
    fixed = P.KerplePower(2, p=2.0, learn_p=False)  # a fixed p may be 2 (Gaussian)
    assert [n for n, _ in fixed.named_parameters()] == ["raw_r1"]
    with pytest.raises(ValueError, match="p must be in"):
        P.KerplePower(2, p=2.5, learn_p=False)


def test_kerple_bias_weight_is_softmax_only_with_the_paper_weight():
    pos = _build("kerple_bias_weight")
    assert pos.softmax_only and isinstance(pos.kernelized_refusal, str) and pos.kernelized_refusal
    W = pos.materialize_weight(6, 8, 1).detach().double()
    r3, r4 = _floats(pos.r3), _floats(pos.r4)
    want = torch.tensor([[[math.exp(-r3[h] * abs(j - i - 1) ** r4[h]) for j in range(8)] for i in range(6)]
                         for h in range(H)], dtype=torch.float64)
    assert_close(W, want, torch.float32)
    for family in FAMILIES:
        if family != "kerple_bias_weight":
            other = _build(family)
            assert not other.softmax_only and other.materialize_weight(3, 3) is None


class _LogCoefficients(nn.Module):
    """`log_coefficients` as a forward, so `functional_call` can swap the parameters."""

    def __init__(self, pos):
        super().__init__()
        self.pos = pos

    def forward(self, Lq, Lk, q_offset):
        out = self.pos.log_coefficients(Lq, Lk, q_offset)
        if self.pos.weight is not None:  # check the weight's gradients as well
            out = torch.cat([out, self.pos.materialize_weight(Lq, Lk, q_offset).flatten(1)], dim=1)
        return out


@pytest.mark.parametrize("family", LEARNABLE)
def test_gradcheck_log_coefficients(family):
    pos = _build(family, num_heads=2).double()
    wrapper = _LogCoefficients(pos)
    names = [f"pos.{n}" for n, _ in pos.named_parameters()]
    values = tuple(p.detach().clone().requires_grad_(True) for p in pos.parameters())

    def f(*vals):
        # Lq=4, Lk=5, q_offset=1: offsets -4..3, r = 0 included
        return torch.func.functional_call(wrapper, dict(zip(names, vals)), (4, 5, 1))

    assert torch.autograd.gradcheck(f, values, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["kerple_power", "kerple_log3", "kerple_bias_weight"])
def test_kerple_gradients_finite_at_zero_offset_with_small_exponent(family):
    pos = {"kerple_power": lambda: P.KerplePower(2, p=0.3),
           "kerple_log3": lambda: P.KerpleLog3(2, p=0.3),
           "kerple_bias_weight": lambda: P.KerpleBiasWeight(2, r2=0.3, r4=0.3)}[family]()
    (pos.materialize(5, 5).sum() + (pos.materialize_weight(5, 5).sum() if pos.weight is not None else 0)).backward()
    for name, prm in pos.named_parameters():
        assert torch.isfinite(prm.grad).all(), name


# ---------------------------------------------------------------------------
# FlexAttention score_mod


@pytest.mark.parametrize("off", [0, 3], ids=lambda o: f"off{o}")
@pytest.mark.parametrize("family", FAMILIES)
def test_score_mod_through_flex_attention_equals_materialize(family, off):
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        pytest.skip("FlexAttention is not in this PyTorch")
    import warnings

    pos = _build(family)
    Lq, Lk, D = 17, 23, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, n, D, generator=g) for n in (Lq, Lk, Lk))
    scale = D ** -0.5
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager-mode advice on CPU
        out = flex_attention(q, k, v, score_mod=pos.score_mod(off), scale=scale)
        s = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * scale
        W = pos.materialize_weight(Lq, Lk, off)
        if W is not None:
            s = s * W.double()
        s = s + pos.materialize(Lq, Lk, off).double()
        ref = torch.softmax(s, dim=-1) @ v.double()
    assert_close(out, ref.float(), torch.float32)


def test_make_builds_every_name_and_refuses_unknown():
    for name in P.NAMES:
        pos = P.make(name, H, causal=True, max_len=64)
        assert isinstance(pos, P.Position) and pos.log_coefficients(3, 4).shape == (H, 6)
    with pytest.raises(ValueError, match="position: unknown name 'kerple'"):
        P.make("kerple", 2)


@pytest.mark.parametrize("make", [
    lambda: P.FastRPB1D(2, 16), lambda: P.LearnedTable(2, 8), lambda: P.Table2D(2, (3, 4), cls_token=True),
    lambda: P.FastRPB2D(2, (3, 4), cls_token=True)], ids=["fastrpb1d", "learned", "table2d", "fastrpb2d"])
def test_zero_init_leaves_the_global_generator_alone(make):
    """Switching on a zero-initialized term must not change the weights the same seed gives
    every other module (it used to draw randn and multiply by 0)."""
    torch.manual_seed(0)
    term = make()
    after = torch.randn(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.randn(3))
    assert all(torch.count_nonzero(p) == 0 for p in term.parameters())


# ---------------------------------------------------------------------------
# KERPLE: the official per-head random initialization beside the means


RANDOM_INIT = {  # family: (parameter, scale of its official U(0, 1) draw) in the official draw order
    "kerple_log": [("r1", 2.0), ("r2", 1.0)],
    "kerple_power": [("p", 2.0), ("r1", 1.0)],
    "kerple_log3": [("r1", 2.0), ("r2", 1.0), ("p", 2.0)],
    "kerple_bias_weight": [("r2", 2.0), ("r1", 1.0), ("r4", 2.0), ("r3", 1.0)],
}


@pytest.mark.parametrize("family", list(RANDOM_INIT))
def test_kerple_random_init_draws_each_head_as_the_official_code(family):
    H8 = 8
    pos = P.make(family, H8, init="random", seed=7)
    g = torch.Generator().manual_seed(7)
    for name, scale in RANDOM_INIT[family]:
        want = (torch.rand(H8, generator=g, dtype=torch.float64) * scale).clamp_min(P.kerple.EPS + 1e-4)
        assert_close(getattr(pos, name).double(), want, torch.float32, msg=name)
        assert len(set(_floats(getattr(pos, name)))) == H8  # one draw per head
    again = P.make(family, H8, init="random", generator=torch.Generator().manual_seed(7))
    other = P.make(family, H8, init="random", seed=8)
    for (a, b), (_, c) in zip(zip(pos.parameters(), again.parameters()), zip(pos.parameters(), other.parameters())):
        assert torch.equal(a, b) and not torch.equal(a, c)


def test_kerple_mean_init_is_unchanged_and_explicit_values_win():
    log = P.KerpleLog(2)
    assert _floats(log.r1) == pytest.approx([1.0, 1.0], rel=1e-6)
    assert _floats(log.r2) == pytest.approx([0.5, 0.5], rel=1e-6)
    power = P.KerplePower(2)
    assert _floats(power.r1) == pytest.approx([0.5, 0.5], rel=1e-6)
    assert _floats(power.p) == pytest.approx([1.0, 1.0], rel=1e-6)
    mixed = P.KerpleLog(3, r1=1.5, init="random", seed=0)
    assert _floats(mixed.r1) == pytest.approx([1.5] * 3, rel=1e-6) and len(set(_floats(mixed.r2))) == 3
    fixed = P.KerplePower(3, learn_p=False, init="random", seed=0)  # a fixed p stays 1: chunked still runs it
    assert _floats(fixed.p) == [1.0] * 3 and fixed.geometric_decay() is not None


def test_kerple_random_init_draws_below_the_floor_start_just_above_it():
    def first_draw(s):
        return float(torch.rand(1, generator=torch.Generator().manual_seed(s), dtype=torch.float64))

    seed = next(s for s in range(5000) if first_draw(s) < 0.004)  # p = 2·draw < EPS
    pos = P.KerplePower(1, init="random", seed=seed)
    assert P.kerple.EPS < float(pos.p.detach()) < P.kerple.EPS + 2e-4


def test_kerple_init_refuses_unknown_names_and_two_sources():
    with pytest.raises(ValueError, match="init: expected one of mean, random"):
        P.KerpleLog(2, init="uniform")
    with pytest.raises(ValueError, match="either generator or seed"):
        P.KerpleLog(2, init="random", seed=1, generator=torch.Generator())
