"""The sum of exponentials' far field walked in blocks (`ops/linear/triton_soe_walk.py`,
`triton_soe.FAR_FIELD = "walk"`) against the dense reference of test_triton_soe.py, written
from the plan's definition: outputs, den, and every gradient (features, values, the plan's `a`
and `corr`), plain and as a quotient, float64 and 16-bit; blocks of one chunk, several, and
one block for all; several stacked terms with padding past K.

Interpreter set-up as in test_triton_chunked.py (TRITON_INTERPRET before triton imports).
"""

import pytest
import torch

_CUDA = torch.cuda.is_available()  # without it, conftest.py has set TRITON_INTERPRET=1
pytest.importorskip("triton")

from fastrpe._validate import FastRPEError  # noqa: E402
from fastrpe.ops.linear import triton_soe as ts  # noqa: E402
from fastrpe.ops.linear import triton_soe_walk as tw  # noqa: E402
from fastrpe.ops.linear.triton_chunked import triton_unavailable_reason  # noqa: E402
from fastrpe.testing import assert_close, features_and_values, weighted_grads  # noqa: E402

import test_triton_band as band  # noqa: E402  (the band's exact reference and cases)
import test_triton_soe as base  # noqa: E402  (its reference, plans and cases)

DEV = torch.device("cuda" if _CUDA else "cpu")
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEV) is not None,
                                reason=str(triton_unavailable_reason(DEV)))


@pytest.fixture
def walk(monkeypatch):
    """`FAR_FIELD = "walk"`, and the stored states' pass made to fail: a walked call never
    builds the K·N states."""
    def no_states(*a, **kw):
        raise AssertionError("the walk built the stored states")

    monkeypatch.setattr(ts, "_soe_states", no_states)
    with ts.use_far_field("walk"):
        yield monkeypatch


CASES = {c.id: c for c in base.CASES}
# (case, WALK_PROGRAMS): B·H rows of programs, so blocks of N / ceil(programs / rows) chunks
WALKS = [
    ("T63-F12-Dv10-W8-C16", 4),  # 4 chunks, 2 blocks of 2
    ("T63-F12-Dv10-W8-C16", 1),  # one block walks every chunk
    ("T1", 1024),
    ("T40-Dv72-two-value-blocks", 2),  # the output walk's value blocks; den by the first only
    ("T45-W20-three-near-chunks", 1024),  # a chunk a block
    ("W60-chunk-raised-to-32", 2),
    ("decode-Lq5-Lk60-off55", 4),
    ("Lq20-Lk50-off10", 6),  # 4 chunks in blocks of 2 (3 asked: ceil)
    ("queries-past-keys", 4),
    ("T63-a-term-per-launch", 4),  # a state budget means nothing to the walk: one pass
]


# "bf16x3" (emulated: exact float64 products here) selects the dq and dk/dv walks' other form,
# their state held transposed, as any 16-bit operand does on the GPU (the module's docstring)
@pytest.mark.parametrize("precision", ["ieee", "bf16x3"], ids=["state", "transposed-state"])
@pytest.mark.parametrize("case,programs", WALKS, ids=[f"{c}-{p}" for c, p in WALKS])
def test_walk_matches_reference(walk, case, programs, precision):
    walk.setattr(tw, "WALK_PROGRAMS", programs)
    args = CASES[case].values
    base.test_soe_matches_reference(*args, precision)
    if case in {c.id for c in base.QUOTIENT_CASES} and precision == "ieee":
        base.test_soe_quotient_matches_reference(*args)


@pytest.mark.parametrize("stack", [1, 2, 4], ids=["KG1", "KG2", "KG4-padded"])
def test_walk_stacks_terms_with_padding(walk, stack):
    """Five terms stacked KG at a time (KG = 4: a second group of one term and three padded
    ones, weight 0), in blocks of two chunks: the reference's sums and gradients."""
    walk.setattr(tw, "WALK_TERMS", stack)
    walk.setattr(tw, "WALK_PROGRAMS", 4)
    assert tw.walk_terms(5) == stack
    base.test_soe_matches_reference(*CASES["T63-F12-Dv10-W8-C16"].values, "ieee", terms=5)


def test_walk_low_precision_against_float64(walk):
    """bf16 features and values (5 terms: padded), within bf16's tolerance of float64 as the
    stored states' path is (`test_soe_low_precision_against_float64`); and a bf16 quotient
    from float32 features."""
    walk.setattr(tw, "WALK_PROGRAMS", 4)
    base.test_soe_low_precision_against_float64(torch.bfloat16)
    base.test_soe_quotient_low_precision_against_float64(None)


def test_walk_and_stored_states_agree_in_float32(monkeypatch):
    """The two far fields give the same float32 sums but for their order (the stored states
    round nothing here: float32 storage), forward and backward."""
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.float32, device=DEV)
    plan = base._plan(2, 8, 4)
    outs = []
    for far in ts.FAR_FIELDS:
        with ts.use_far_field(far):
            num, den, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16)
            outs.append((num, den, *weighted_grads((num, den), (q, k, v, plan.a, plan.corr))))
    for name, a, b in zip(("num", "den", "dq", "dk", "dv", "da", "dcorr"), *outs):
        assert_close(a, b, torch.float32, msg=name)


def test_the_forwards_carries_spare_the_backward_its_totals(walk):
    """A forward with a backward to come keeps its blocks' carries (`far_forward`'s), and the
    backward makes no key totals again; with `use_saved_states(-1)` it makes them again: the
    same gradients bit for bit (blocks of two chunks)."""
    walk.setattr(tw, "WALK_PROGRAMS", 4)
    calls = []
    real = tw._key_carries
    walk.setattr(tw, "_key_carries", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = features_and_values(1, 2, 63, 63, 12, 10, dtype=torch.float64, device=DEV)
    plan = base._plan(2, 8, 5)
    grads = []
    for keep in (0, -1):
        with ts.use_saved_states(keep):
            num, den, _ = ts.kernelized_num_den_triton_soe(q, k, v, plan, chunk_size=16)
        grads.append(weighted_grads((num, den), (q, k, v, plan.a, plan.corr)))
        assert len(calls) == (1 if keep == 0 else 2), keep  # forward only; forward and backward
        calls.clear()
    for name, a, b in zip(("dq", "dk", "dv", "da", "dcorr"), *grads):
        assert torch.equal(a, b), name


def test_backward_keeps_its_forwards_far_field(monkeypatch):
    """A forward under `use_far_field("walk")` is differentiated the walk's way after the block
    has ended (the mode travels with the call, as the state scan's does)."""
    calls = []
    real = tw.far_backward
    monkeypatch.setattr(tw, "far_backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = features_and_values(1, 2, 20, 20, 12, 10, dtype=torch.float64, device=DEV)
    with ts.use_far_field("walk"):
        num, den, _ = ts.kernelized_num_den_triton_soe(q, k, v, base._plan(2, 8, 4), chunk_size=16)
    assert ts.FAR_FIELD == "states"
    (num.sum() + den.sum()).backward()
    assert calls == [1]


BAND = {c.id: c for c in band.CASES}


@pytest.mark.parametrize("case,programs", [("T100-W33-far-field-past-three-near-chunks", 4), ("T63-W8", 1),
                                           ("decode-Lq5-Lk60-off55", 1024)],
                         ids=["three-near-chunks-blocks-of-2", "one-block", "decode-a-chunk-a-block"])
def test_walk_runs_finite_support_tables_exactly(walk, case, programs):
    """`triton_band` (a table exact within its band, constant beyond: one term with γ = 1)
    through the walk: exact, forward and backward (the table's gradient included)."""
    walk.setattr(tw, "WALK_PROGRAMS", programs)
    band.test_band_kernel_is_exact(*BAND[case].values, "ieee")


def test_walk_never_sees_the_future(walk):
    """Keys and values changed after position 30 leave outputs up to 30 alone (blocks of 2)."""
    walk.setattr(tw, "WALK_PROGRAMS", 4)
    band.test_band_kernel_never_sees_the_future()


def test_walk_blocks_cover_the_chunks():
    for N in (1, 2, 7, 64, 1000, 16384):
        for rows in (1, 3, 8, 64, 5000):
            for programs in (1, 5, 1024):
                G, nbk = tw.walk_blocks(N, rows, programs)
                assert G >= 1 and 1 <= nbk <= N
                assert (nbk - 1) * G < N <= nbk * G  # every chunk in one block, no block empty
                assert nbk <= max(1, -(-programs // rows))
    assert tw.walk_blocks(16384, 8) == (128, 128)  # 1M tokens: 128 blocks of 128 chunks
    assert tw.walk_blocks(1024, 8) == (8, 128)  # 64k


def test_use_far_field_refuses_an_unknown_mode():
    with pytest.raises(FastRPEError, match="use_far_field"):
        with ts.use_far_field("stored"):
            pass
    assert ts.FAR_FIELD == "states"


@pytest.mark.gpu
def test_walk_gpu_realistic_size_bf16():
    """`test_soe_gpu_realistic_size_bf16` (L=4096, H=8, F=32, Dv=64, 16 terms) walked."""
    if not _CUDA:
        pytest.skip("needs CUDA")
    with ts.use_far_field("walk"):
        base.test_soe_gpu_realistic_size_bf16()
