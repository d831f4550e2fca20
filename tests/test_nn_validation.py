"""Every `fastrpe.nn` layer and model refuses bad input or configuration with one
`FastRPEError` naming the argument, at construction or at the call (never an einops,
matmul or index error from deep inside); and `fr.attention` refuses `scale=inf`."""
from __future__ import annotations

import warnings

import pytest
import torch

import fastrpe as fr
from fastrpe import FastRPEError
from fastrpe.nn import (
    DecoderLM,
    EncoderClassifier,
    EncoderConfig,
    KVCache,
    LMConfig,
    MultiheadAttention,
    Seq2Seq,
    Seq2SeqConfig,
    ViTConfig,
    VisionTransformer,
)

E, H = 8, 2


def mha(**kw):
    torch.manual_seed(0)
    return MultiheadAttention(E, H, **kw)


x3 = torch.randn(2, 5, E)

MHA_CALLS = [
    ("rank 2 (unbatched)", lambda: mha()(torch.randn(5, E)), r"query must have 3 dimensions \[B, L, E\]"),
    ("rank 4", lambda: mha()(torch.randn(1, 2, 5, E)), r"query must have 3 dimensions"),
    ("wrong width", lambda: mha()(torch.randn(2, 5, E + 1)), r"query's last dimension must be 8"),
    ("float64 input, float32 layer", lambda: mha()(x3.double()), r"query has dtype torch.float64 but the layer's weights are torch.float32"),
    ("int input", lambda: mha()(torch.randint(0, 3, (2, 5, E))), r"query must be a floating point"),
    ("not a tensor", lambda: mha()([[1.0] * E]), r"query must be a torch.Tensor"),
    ("kdim mismatch", lambda: mha(kdim=4)(x3, torch.randn(2, 5, E)), r"key's last dimension must be 4"),
    ("vdim mismatch", lambda: mha(vdim=3)(x3, torch.randn(2, 5, E), torch.randn(2, 5, 4)),
     r"value's last dimension must be 3"),
    ("key/value lengths", lambda: mha()(x3, torch.randn(2, 5, E), torch.randn(2, 6, E)), r"key has 5 positions, value 6"),
    ("batch sizes", lambda: mha()(x3, torch.randn(3, 5, E)), r"batch sizes differ"),
    ("seq-first width", lambda: mha(batch_first=False)(torch.randn(5, 2, E - 1)), r"\[L, B, E\].*|last dimension"),
    ("step on non-causal", lambda: mha().step(x3), r"causal=False"),
    ("step rank 2", lambda: mha(causal=True).step(torch.randn(2, E)), r"step: x must have 3 dimensions"),
    ("step width", lambda: mha(causal=True).step(torch.randn(2, 1, E + 2)), r"step: x's last dimension must be 8"),
    ("step int", lambda: mha(causal=True).step(torch.ones(2, 1, E, dtype=torch.long)), r"step: x must be a floating"),
    ("step cache type", lambda: mha(causal=True).step(x3, cache=(1, 2)), r"cache.*KVCache, LinearState"),
    ("step cache batch", lambda: mha(causal=True).step(x3, KVCache(torch.zeros(3, H, 4, E // H),
                                                                  torch.zeros(3, H, 4, E // H))),
     r"x has batch 2, the cache 3"),
    ("step with kdim", lambda: mha(causal=True, kdim=4).step(x3), r"kdim/vdim"),
]


@pytest.mark.parametrize("call,match", [pytest.param(c, m, id=i) for i, c, m in MHA_CALLS])
def test_multihead_attention_calls(call, match):
    with pytest.raises(FastRPEError, match=match):
        call()


@pytest.mark.parametrize("kw,match", [
    (dict(embed_dim=10, num_heads=3), r"embed_dim \(10\) must be a positive multiple of num_heads \(3\)"),
    (dict(embed_dim=0, num_heads=2), r"embed_dim must be a positive int"),
    (dict(embed_dim=8.0, num_heads=2), r"embed_dim must be a positive int"),
    (dict(embed_dim=8, num_heads=2, backend="nope"), r"backend: unknown backend 'nope'"),
    (dict(embed_dim=8, num_heads=2, kernel="nope"), r"kernel"),
    (dict(embed_dim=8, num_heads=2, kdim=0), r"kdim must be a positive int"),
    (dict(embed_dim=8, num_heads=2, dropout=1.0), r"dropout"),
    (dict(embed_dim=8, num_heads=2, causal="yes"), r"causal must be a bool"),
], ids=["heads", "zero", "float", "backend", "kernel", "kdim", "dropout", "causal"])
def test_multihead_attention_construction(kw, match):
    with pytest.raises(ValueError, match=match):  # FastRPEError is a ValueError (kernel errors come from get_kernel)
        MultiheadAttention(**kw)


def test_float64_is_supported_end_to_end():
    """A float64 layer takes float64 input (and is exact against float32 to float32's precision)."""
    m = mha(kernel="elu", position=fr.positions.KerpleLog(H), causal=True)
    x = torch.randn(2, 7, E, dtype=torch.float64)
    out64 = m.double()(x)
    assert out64.dtype == torch.float64
    out32 = m.float()(x.float())
    torch.testing.assert_close(out32.double(), out64, rtol=1e-4, atol=1e-5)
    o, cache = m.double().step(x[:, :3])
    assert o.dtype == torch.float64


def test_valid_calls_still_work():
    m = mha(causal=True)
    out = m(x3)
    o1, c = m.step(x3[:, :3])
    o2, c = m.step(x3[:, 3:], c)
    torch.testing.assert_close(torch.cat([o1, o2], 1), out, rtol=1e-5, atol=1e-5)
    assert mha(kdim=4, vdim=3)(x3, torch.randn(2, 6, 4), torch.randn(2, 6, 3)).shape == (2, 5, E)


# ----------------------------------------------------------------------------------------
# models


def _lm():
    torch.manual_seed(0)
    return DecoderLM(LMConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=1))


def _enc():
    torch.manual_seed(0)
    return EncoderClassifier(EncoderConfig(vocab_size=11, num_classes=3, d_model=16, n_heads=2, n_layers=1))


def _s2s():
    torch.manual_seed(0)
    return Seq2Seq(Seq2SeqConfig(vocab_size=11, d_model=16, n_heads=2, n_enc_layers=1, n_dec_layers=1))


ok = torch.tensor([[1, 2, 3]])
BAD_TOKENS = [
    (torch.tensor([[1, 11]]), r"tokens holds id 11, outside the vocabulary 0..10"),
    (torch.tensor([[-1, 2]]), r"holds id -1"),
    (torch.tensor([[1.0, 2.0]]), r"must hold integer token ids, got dtype torch.float32"),
    (torch.tensor([[True, False]]), r"integer token ids"),
    (torch.tensor([1, 2]), r"must have 2 dimensions \[B, L\]"),
    ([[1, 2]], r"must be an integer torch.Tensor"),
]


@pytest.mark.parametrize("tokens,match", BAD_TOKENS, ids=["too-big", "negative", "float", "bool", "rank1", "list"])
def test_decoder_lm_tokens(tokens, match):
    m = _lm()
    for call in (lambda: m(tokens), lambda: m.step(tokens), lambda: m.loss(tokens)):
        with pytest.raises(FastRPEError, match=match.replace("tokens holds", "holds")):
            call()
    assert m(ok).shape == (1, 3, 11)


@pytest.mark.parametrize("tokens,match", BAD_TOKENS[:3], ids=["too-big", "negative", "float"])
def test_encoder_and_seq2seq_tokens(tokens, match):
    match = match.replace("tokens holds", "holds")
    with pytest.raises(FastRPEError, match="EncoderClassifier: .*" + match):
        _enc()(tokens)
    s2s = _s2s()
    with pytest.raises(FastRPEError, match="Seq2Seq: src " + match):
        s2s(tokens, ok)
    with pytest.raises(FastRPEError, match="tgt_in"):
        s2s(ok, tokens)
    assert _enc()(ok).shape == (1, 3) and s2s(ok, ok).shape == (1, 3, 11)


def test_encoder_padding_mask():
    with pytest.raises(FastRPEError, match="padding_mask must be a bool tensor"):
        _enc()(ok, padding_mask=torch.zeros(1, 3))
    with pytest.raises(FastRPEError, match="padding_mask must be a bool tensor of the tokens' shape"):
        _enc()(ok, padding_mask=torch.zeros(1, 4, dtype=torch.bool))


@pytest.mark.parametrize("cls", [LMConfig, EncoderConfig, Seq2SeqConfig, ViTConfig])
def test_configs_refuse_at_construction(cls):
    with pytest.raises(FastRPEError, match=rf"{cls.__name__}: field 'backend': unknown backend 'nope'"):
        cls(backend="nope")
    with pytest.raises(ValueError, match=rf"{cls.__name__}: field 'kernel'"):
        cls(kernel="nope")
    with pytest.raises(ValueError, match=rf"{cls.__name__}: field 'n_heads'|{cls.__name__}: field 'd_model'"):
        cls(d_model=30, n_heads=4)


def test_vision_transformer_images():
    torch.manual_seed(0)
    vit = VisionTransformer(ViTConfig(image_size=8, patch_size=4, d_model=16, n_heads=2, n_layers=1))
    with pytest.raises(FastRPEError, match=r"expected images \[B, 1, 8, 8\]"):
        vit(torch.rand(2, 8, 8))
    with pytest.raises(FastRPEError, match="images must be floating point"):
        vit(torch.randint(0, 255, (2, 1, 8, 8), dtype=torch.uint8))
    with pytest.raises(FastRPEError, match="images has dtype torch.float64"):
        vit(torch.rand(2, 1, 8, 8, dtype=torch.float64))
    with pytest.raises(FastRPEError, match=r"forward_tokens: expected tokens \[B, 5, 16\]"):
        vit.forward_tokens(torch.rand(2, 4, 16))
    assert vit(torch.rand(2, 1, 8, 8)).shape == (2, 10)


# ----------------------------------------------------------------------------------------
# functional API


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), -1.0, 0.0, True], ids=str)
def test_attention_scale_must_be_positive_and_finite(scale):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(FastRPEError, match="scale must be a positive finite number or None"):
        fr.attention(q, q, q, scale=scale)


def test_underflowed_rows_warn_once(monkeypatch):
    """Unnormalized exp/prf at q/k norms ~1e3 return zero rows (the documented rule): said once,
    attributed to the caller's line; normalized maps do not underflow and do not warn."""
    from fastrpe import _validate

    monkeypatch.setattr(_validate, "_ZERO_ROWS_WARNED", set())
    torch.manual_seed(0)
    q, v = torch.randn(1, 2, 6, 4) * 1e3, torch.randn(1, 2, 6, 4)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fr.attention(q, q.flip(2), v, kernel="exp")
        fr.attention(q, q.flip(2), v, kernel="exp")  # the second call is quiet
        fr.attention(q, q.flip(2), v, kernel="nexp")  # normalized: no zero rows, no warning
        fr.attention(q / 1e3, q.flip(2) / 1e3, v, kernel="prf")  # moderate norms: nothing to say
    msgs = [x for x in w if issubclass(x.category, RuntimeWarning)]
    assert bool((out.abs().sum(-1) == 0).any())
    assert len(msgs) == 1 and "kernel 'exp'" in str(msgs[0].message) and msgs[0].filename == __file__
