"""The FlexAttention op (`fastrpe.ops.softmax.flex`): its causal `BlockMask`, built from block
indices, against `create_block_mask`'s; the query offset it adds for the score_mod; and its
compiled path, which must compile once per shape, not once per offset, and must not fall back
to eager FlexAttention at Dynamo's default recompile limit."""
from __future__ import annotations

import pytest
import torch

from fastrpe import positions as P
from fastrpe.ops.softmax import flex as F
from fastrpe.ops.softmax.naive import softmax_attention_naive
from fastrpe.testing import assert_close, qkv

pytestmark = pytest.mark.skipif(not F.flex_available(), reason="FlexAttention is not in this PyTorch")

H = 3
MASK_CASES = [(200, 200, 0), (130, 300, 170), (257, 100, 0), (1, 9, 8), (150, 150, 20), (384, 384, 0),
              (256, 640, 384), (129, 700, 500), (300, 128, 0)]
MASK_IDS = ["L200", "Lq130-Lk300-off170", "queries-past-keys", "Lq1", "off20", "whole-blocks", "offset-whole",
            "ragged-offset", "more-queries"]


def _t5(seed=0):
    pos = P.T5Bias(H, num_buckets=16, max_distance=64, bidirectional=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        pos.embedding.add_(0.3 * torch.randn(pos.embedding.shape, generator=g))
    return pos


@pytest.mark.parametrize("Lq,Lk,q_offset", MASK_CASES, ids=MASK_IDS)
def test_causal_block_mask_has_create_block_masks_blocks(Lq, Lk, q_offset):
    """The blocks found in closed form are the ones `create_block_mask` finds by reading the
    mask `j <= q_offset + i`: counts and indices, partial and full, by rows and by columns."""
    from torch.nn.attention.flex_attention import create_block_mask

    got = F.causal_block_mask(Lq, Lk, q_offset, torch.device("cpu"))
    want = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + q_offset, None, None, Lq, Lk,
                             device="cpu")
    assert got.shape[-2:] == (Lq, Lk) and got.BLOCK_SIZE == want.BLOCK_SIZE
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    q_pos = torch.arange(Lq)[:, None] + q_offset
    assert torch.equal(got.to_dense()[0, 0], want.to_dense()[0, 0])
    assert (got.to_dense()[0, 0].sum() > 0) == bool((torch.arange(Lk)[None, :] <= q_pos).any())


@pytest.mark.parametrize("Lq,Lk,q_offset", MASK_CASES, ids=MASK_IDS)
def test_block_mask_and_offset_give_the_naive_output(Lq, Lk, q_offset):
    """With the causal `BlockMask` forced (eager Flex on CPU), a score_mod that sees the query's
    position `q_offset + q_idx`, and key padding: the naive op's output, lengths that are not
    multiples of the 128-token blocks included."""
    q, k, v = qkv(2, H, Lq, Lk, 16, 7, dtype=torch.float32)
    pos = _t5()
    kpm = torch.zeros(2, Lk, dtype=torch.bool)
    kpm[1, ::5] = True
    with torch.no_grad():
        ref = softmax_attention_naive(q, k, v, pos.materialize(Lq, Lk, q_offset), causal=True, q_offset=q_offset,
                                      key_padding_mask=kpm)
        for block_mask in (True, False):
            out = F.softmax_attention_flex(q, k, v, pos.score_mod(), causal=True, q_offset=q_offset,
                                           key_padding_mask=kpm, block_mask=block_mask)
            assert_close(out, ref)


def test_what_runs_fused():
    """Compiled on CUDA from `COMPILE_MIN_QUERIES` queries (a decoding step, a new key length at
    each call, runs eagerly); never on the CPU."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    n = F.COMPILE_MIN_QUERIES
    assert F.flex_fused(cuda, n) and not F.flex_fused(cuda, n - 1) and not F.flex_fused(cuda, 1)
    assert not F.flex_fused(cpu, 4 * n)


def test_compiled_path_compiles_once_per_shape_not_per_offset(monkeypatch):
    """The compiled path, forced on CPU (forward; compiled Flex has no CPU backward), under a
    recompile limit of 1 that fails when hit: a second offset at the same shape compiles
    nothing (the offset is a tensor); a second shape compiles rather than falling back to eager
    FlexAttention (the limit is raised for the call). Outputs equal the naive op's."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(F, "flex_fused", lambda device, Lq: Lq >= F.COMPILE_MIN_QUERIES)
    torch._dynamo.reset()
    pos = _t5().requires_grad_(False)
    graphs = []
    try:
        with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True), torch.no_grad():
            for Lk, off in ((256, 128), (256, 100), (384, 256)):
                q, k, v = qkv(1, H, 128, Lk, 16, seed=Lk + off, dtype=torch.float32)
                out = F.softmax_attention_flex(q, k, v, pos.score_mod(), causal=True, q_offset=off)
                ref = softmax_attention_naive(q, k, v, pos.materialize(128, Lk, off), causal=True, q_offset=off)
                assert_close(out, ref)
                graphs.append(counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.reset()
    assert graphs[1] == graphs[0] and graphs[2] == graphs[1] + 1, graphs


def test_a_decoding_step_compiles_nothing_under_the_cuda_rule(monkeypatch):
    """`flex_fused`'s CUDA rule forced on CPU: decoding steps (one query, one more key each)
    run eager FlexAttention, which traces its score_mod with Dynamo's eager backend (Dynamo's
    `unique_graphs` grows: not a compile) but sends no graph through AOTAutograd, Inductor's
    way in; 128 queries then compile once. (Dynamo's count is what
    tests/test_gpu.py::test_flex_compiles_nothing_per_decoding_step_and_once_for_all_offsets
    read until it failed on the H100, 2026-11-27.) Outputs equal the naive op's."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(F, "flex_fused", lambda device, Lq: Lq >= F.COMPILE_MIN_QUERIES)
    torch._dynamo.reset()
    pos = _t5().requires_grad_(False)
    n = F.COMPILE_MIN_QUERIES
    try:
        with torch.no_grad():
            before = counters["aot_autograd"]["total"]
            for Lk in range(200, 204):
                q, k, v = qkv(1, H, 1, Lk, 16, seed=Lk, dtype=torch.float32)
                out = F.softmax_attention_flex(q, k, v, pos.score_mod(), causal=True, q_offset=Lk - 1)
                ref = softmax_attention_naive(q, k, v, pos.materialize(1, Lk, Lk - 1), causal=True, q_offset=Lk - 1)
                assert_close(out, ref)
            assert counters["aot_autograd"]["total"] == before, "a decoding step compiled"
            q, k, v = qkv(1, H, n, 256, 16, seed=1, dtype=torch.float32)
            out = F.softmax_attention_flex(q, k, v, pos.score_mod(), causal=True, q_offset=256 - n)
            assert_close(out, softmax_attention_naive(q, k, v, pos.materialize(n, 256, 256 - n), causal=True,
                                                      q_offset=256 - n))
            assert counters["aot_autograd"]["total"] == before + 1
    finally:
        torch._dynamo.reset()

@pytest.mark.parametrize("term,gathers", [("t5", True), ("learned", True), ("alibi", False), ("kerple", False)])
def test_a_score_mod_that_gathers_gets_the_small_tiles_where_flex_is_fused(monkeypatch, term, gathers):
    """On the H100 image Inductor's default tiles ran out of shared memory for every T5 and
    learned-table score_mod (a gather per query-key pair), not for ALiBi or KERPLE: the `flex`
    backend passes `GATHER_KERNEL_OPTIONS` for the gathering terms, to the fused kernels only
    (eager FlexAttention has no tiles). The fused call is stood in for by a recorder here."""
    import fastrpe as fr

    seen, eager = [], F._flex_attention

    def fused(q, k, v, **kw):
        seen.append(kw.pop("kernel_options", None))
        return eager(q, k, v, **kw)

    make = {"t5": _t5, "learned": lambda: P.LearnedTable(H, max_distance=40, init_std=0.3),
            "alibi": lambda: P.ALiBi(H), "kerple": lambda: P.KerpleLog(H)}
    pos = make[term]().requires_grad_(False)
    assert pos.score_mod_gathers is gathers
    q, k, v = qkv(1, H, 130, 130, 16, seed=1, dtype=torch.float32)
    with torch.no_grad():
        monkeypatch.setattr(F, "_flex", lambda: fused)
        monkeypatch.setattr(F, "flex_fused", lambda device, Lq: Lq >= F.COMPILE_MIN_QUERIES)
        out = fr.attention(q, k, v, kernel="softmax", position=pos, backend="flex")
        assert seen == [F.GATHER_KERNEL_OPTIONS if gathers else None]
        assert_close(out, softmax_attention_naive(q, k, v, pos.materialize(130, 130)))
        monkeypatch.setattr(F, "flex_fused", lambda device, Lq: False)  # eager: no options
        monkeypatch.setattr(F, "_flex_attention", fused)
        fr.attention(q[:, :, :5], k, v, kernel="softmax", position=pos, backend="flex")
        assert seen[-1] is None
