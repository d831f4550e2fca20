"""`auto`'s decision is cached per problem signature and never outlives what it was made for."""
from __future__ import annotations

import gc

import pytest
import torch

import fastrpe as fr
from fastrpe import dispatch


@pytest.fixture
def count_explains(monkeypatch):
    calls = []
    real = dispatch.explain_problem

    def counting(p, *a, **kw):
        calls.append(p)
        return real(p, *a, **kw)

    monkeypatch.setattr(dispatch, "explain_problem", counting)
    dispatch.clear_dispatch_cache()
    return calls


def _qkv(L=16, H=2, D=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, H, L, D, generator=g, dtype=torch.float64) for _ in range(3)]


def test_repeated_calls_decide_once(count_explains):
    q, k, v = _qkv()
    pos = fr.positions.KerpleLog(2)
    outs = [fr.attention(q, k, v, "nelu", pos, causal=True) for _ in range(5)]
    assert len(count_explains) == 1
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_a_new_shape_flag_or_term_decides_again(count_explains):
    q, k, v = _qkv()
    pos = fr.positions.KerpleLog(2)
    fr.attention(q, k, v, "nelu", pos, causal=True)
    fr.attention(q[:, :, :7], k, v, "nelu", pos, causal=True)  # Lq
    fr.attention(q, k, v, "nelu", pos, causal=False)  # causal
    fr.attention(q, k, v, "softmax", pos, causal=True)  # kernel
    fr.attention(q, k, v, "nelu", fr.positions.KerpleLog(2), causal=True)  # another term object
    assert len(count_explains) == 5


def test_structure_not_parameters_is_the_key(count_explains):
    """Same term, other parameter values: cached. Other configuration: decided again."""
    q, k, v = _qkv()
    pos = fr.positions.T5Bias(2)
    fr.attention(q, k, v, "nelu", pos, causal=True)
    with torch.no_grad():
        for prm in pos.parameters():
            prm.add_(1.0)
    fr.attention(q, k, v, "nelu", pos, causal=True)
    assert len(count_explains) == 1


def test_decisions_die_with_their_term():
    q, k, v = _qkv()
    pos = fr.positions.KerpleLog(2)
    fr.attention(q, k, v, "nelu", pos, causal=True)
    assert pos in dispatch._AUTO_CACHE
    n = len(dispatch._AUTO_CACHE)
    del pos
    gc.collect()
    assert len(dispatch._AUTO_CACHE) == n - 1


def test_cached_choice_equals_a_fresh_one():
    q, k, v = _qkv(L=33)
    pos = fr.positions.ALiBi(2)
    for causal in (True, False):
        dispatch.clear_dispatch_cache()
        fresh = fr.explain(q, k, v, "nelu", pos, causal=causal).chosen
        p, _ = fr.api._problem(q, k, v, "nelu", pos, causal, None, None, None)
        assert dispatch.select_backend(p, "auto").name == fresh
        assert dispatch.select_backend(p, "auto").name == fresh  # from the cache


def test_a_frozen_terms_coefficient_table_is_kept_per_shape_and_parameter_state(count_calls, monkeypatch):
    """`backends._coefficients`: a term that takes no gradient is evaluated once per shape and
    parameter state (T5's bucketing is ~35 small launches a GPU call would pay every time); an
    in-place edit is seen; a term in training is evaluated in the graph every call."""
    import fastrpe.backends as B
    from fastrpe import positions as P

    pos = P.T5Bias(2, bidirectional=False, num_buckets=8, max_distance=24)
    evals = count_calls(pos, "log_coefficients")
    pos.requires_grad_(False)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def run(**kw):
        return fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend="band", **kw)

    first = run()
    assert torch.equal(run(), first) and len(evals) == 1
    with torch.no_grad():
        pos.embedding.add_(torch.randn(pos.embedding.shape, generator=torch.Generator().manual_seed(9)))  # a step
    edited = run()
    assert len(evals) == 2 and not torch.equal(edited, first)
    pos.requires_grad_(False)
    fr.attention(q[:, :, :30], k, v, kernel="elu", position=pos, causal=True, backend="band")
    assert len(evals) == 3  # another shape, another table
    pos.requires_grad_(True)
    run().sum().backward()
    run()
    assert len(evals) == 5 and pos.embedding.grad.abs().sum() > 0
    monkeypatch.setattr(B, "TABLE_MEMO_BYTES", 0)  # over the size limit: not kept
    B._TABLES.clear()
    pos.requires_grad_(False)
    run(), run()
    assert len(evals) == 7


def test_a_frozen_terms_decays_are_kept_per_parameter_state(count_calls):
    """`backends._decay`: a geometric term that takes no gradient makes its decays once per
    parameter state (three launches a call, in the backend's reasons and in its run); an
    in-place edit is seen; a term in training makes them in the graph on every call."""
    from fastrpe import positions as P

    pos = P.GeometricDecay(2, learnable=True)
    evals = count_calls(pos, "geometric_decay")
    pos.requires_grad_(False)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def run():
        return fr.attention(q, k, v, kernel="elu", position=pos, causal=True, backend="chunked")

    first = run()
    n = len(evals)
    assert torch.equal(run(), first) and len(evals) == n
    with torch.no_grad():
        pos.raw_rate.add_(0.5)  # an optimizer step
    assert not torch.equal(run(), first) and len(evals) == n + 1
    pos.requires_grad_(True)
    run().sum().backward()
    assert len(evals) > n + 1 and pos.raw_rate.grad.abs().sum() > 0
