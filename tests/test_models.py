"""Each model trains a few steps and the loss falls; decoding through the step API
equals the argmax of full forward passes."""
from __future__ import annotations

import pytest
import torch

import fastrpe as fr
from fastrpe.nn import DecoderLM, EncoderClassifier, EncoderConfig, LMConfig, Seq2Seq, Seq2SeqConfig

LM_CASES = [("softmax", "kerple_log"), ("softmax", "alibi"), ("softmax", "t5"), ("softmax", "sinusoidal"),
            ("softmax", "rotary"), ("nprf", "kerple_log"), ("elu", "kerple_power"), ("elu", "none"),
            ]


def _train(model, loss_fn, steps=30, lr=3e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kernel,position", LM_CASES, ids=[f"{k}-{p}" for k, p in LM_CASES])
def test_lm_learns_and_decodes(kernel, position):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=12, d_model=32, n_layers=2, n_heads=4, kernel=kernel, position=position)
    model = DecoderLM(cfg)
    # a periodic sequence is learnable in a few steps
    data = torch.arange(33).repeat(8, 1) % 5 + 1
    losses = _train(model, lambda: model.loss(data))
    assert losses[-1] < 0.7 * losses[0], losses
    model.eval()
    prompt = data[:2, :7]
    gen = model.generate(prompt, 6)
    seq = prompt
    for _ in range(6):  # the argmax of full forward passes
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(gen, seq)


def test_lm_step_equals_forward_float64():
    torch.manual_seed(0)
    model = DecoderLM(LMConfig(vocab_size=12, d_model=32, n_heads=4, position="kerple_log", kernel="nprf")).double()
    x = torch.randint(0, 12, (2, 15))
    full = model(x)
    logits, caches = model.step(x[:, :5])
    outs = [logits]
    for t in range(5, 15):
        logits, caches = model.step(x[:, t:t + 1], caches)
        outs.append(logits)
    torch.testing.assert_close(torch.cat(outs, 1), full)


@pytest.mark.parametrize("kernel", ["softmax", "elu"])
def test_encoder_classifier_learns(kernel):
    torch.manual_seed(0)
    cfg = EncoderConfig(vocab_size=10, num_classes=3, d_model=32, n_heads=4, kernel=kernel, position="kerple_log",
                        fastrpb=(kernel == "elu"))
    model = EncoderClassifier(cfg)
    x = torch.randint(1, 10, (24, 20))
    x[:, 15:] = 0  # padding
    y = x[:, 0] % 3  # label = first token mod 3
    losses = _train(model, lambda: torch.nn.functional.cross_entropy(model(x), y), steps=40)
    assert losses[-1] < 0.5 * losses[0], losses


def _copy_batch(B=16, S=8, vocab=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, vocab, (B, S), generator=g)
    tgt = torch.cat([torch.full((B, 1), 1), src.flip(1), torch.full((B, 1), 2)], 1)  # BOS reversed EOS
    return src, tgt


def test_seq2seq_learns_and_decodes():
    torch.manual_seed(0)
    model = Seq2Seq(Seq2SeqConfig(vocab_size=12, d_model=32, n_heads=4, position="kerple_log"))
    src, tgt = _copy_batch()
    losses = _train(model, lambda: model.loss(src, tgt), steps=40)
    assert losses[-1] < 0.6 * losses[0], losses
    model.eval()
    gen = model.generate(src[:3], max_len=9)
    # greedy through the step API = argmax of teacher-forced full passes on its own output
    seq = gen[:, :1]
    for _ in range(gen.shape[1] - 1):
        seq = torch.cat([seq, model(src[:3], seq)[:, -1].argmax(-1, keepdim=True)], 1)
    done = (gen == 2).cumsum(1) > 0  # compare up to and including EOS
    keep = torch.cat([torch.ones_like(done[:, :1]), ~done[:, :-1]], 1)
    assert torch.equal(gen[keep], seq[keep])
    beams = model.beam_search(src[:3], max_len=9, beam_size=3)
    assert beams.shape[0] == 3 and bool((beams[:, 0] == 1).all())


def test_config_refuses_unknown_and_invalid_fields():
    with pytest.raises(ValueError, match="unknown field 'dmodel'"):
        LMConfig.from_dict({"dmodel": 3})
    with pytest.raises(ValueError, match="field 'n_layers' must be >= 0"):
        LMConfig.from_dict({"n_layers": -1})
    with pytest.raises(ValueError, match="'d_model'"):
        LMConfig.from_dict({"d_model": 30, "n_heads": 4})
    assert LMConfig.from_json(LMConfig(d_model=64).to_json()) == LMConfig(d_model=64)


@pytest.mark.parametrize("kernel", ["elu", "prf", "softmax"])
def test_lm_with_shaw_trains_and_step_equals_forward(kernel):
    """Scaleformer's model: a feature map with Shaw's vectors and no absolute encoding."""
    torch.manual_seed(0)
    model = DecoderLM(LMConfig(vocab_size=12, d_model=32, n_layers=1, n_heads=4, position="shaw", kernel=kernel,
                               num_features=16))
    shaw = model.blocks[0].attn.position
    assert isinstance(shaw, fr.positions.ShawRelative) and shaw.positive == (kernel != "softmax")
    assert shaw.dim == {"elu": 8, "prf": 16, "softmax": 8}[kernel]  # the width of the layer's features
    data = torch.arange(17).repeat(4, 1) % 5 + 1
    losses = _train(model, lambda: model.loss(data), steps=8, lr=1e-2)
    assert losses[-1] < 0.9 * losses[0], losses
    model.double()
    x = torch.randint(0, 12, (2, 19))
    full = model(x)
    logits, caches = model.step(x[:, :5])
    outs = [logits]
    for t in range(5, 19):
        logits, caches = model.step(x[:, t:t + 1], caches)
        outs.append(logits)
    torch.testing.assert_close(torch.cat(outs, 1), full)


def test_encoder_with_shaw_trains():
    torch.manual_seed(0)
    model = EncoderClassifier(EncoderConfig(vocab_size=10, num_classes=3, d_model=16, n_layers=1, n_heads=2,
                                            kernel="elu", position="shaw"))
    x = torch.randint(1, 10, (16, 12))
    y = x[:, 0] % 3
    losses = _train(model, lambda: torch.nn.functional.cross_entropy(model(x), y), steps=10, lr=1e-2)
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("position", ["none", "alibi", "kerple_power_p1", "geometric"])
def test_constant_memory_decoding_equals_forward(position):
    """Kernelized attention with a geometric (or no) positional term decodes with a
    constant-size state, and matches the full forward pass."""
    torch.manual_seed(0)
    model = DecoderLM(LMConfig(vocab_size=12, d_model=32, n_heads=4, position=position, kernel="elu")).double()
    x = torch.randint(0, 12, (2, 40))
    full = model(x)
    logits, caches = model.step(x[:, :9])
    assert all(isinstance(c, fr.nn.LinearState) for c in caches)
    size = [c.S.numel() for c in caches]
    outs = [logits]
    for t in range(9, 40):
        logits, caches = model.step(x[:, t:t + 1], caches)
        outs.append(logits)
    assert [c.S.numel() for c in caches] == size  # constant memory per step
    torch.testing.assert_close(torch.cat(outs, 1), full)


def test_seq2seq_beam_search_with_recurrent_decoder_state():
    torch.manual_seed(0)
    model = Seq2Seq(Seq2SeqConfig(vocab_size=12, d_model=32, n_heads=4, kernel="elu", position="alibi",
                                  cross_position="none"))
    src, _ = _copy_batch(B=3)
    out = model.beam_search(src, max_len=6, beam_size=2)
    assert out.shape[0] == 3


def test_seq2seq_with_a_kernel_per_attention_learns_and_decodes():
    """Luo et al. Table 3: softmax encoder, PRF decoder (self and cross), each with its own width."""
    torch.manual_seed(0)
    cfg = Seq2SeqConfig(vocab_size=12, d_model=32, n_heads=4, n_enc_layers=1, n_dec_layers=1, position="kerple_log",
                        cross_position="none", enc_kernel="softmax", dec_kernel="prf", dec_num_features=16,
                        cross_kernel="nelu")
    model = Seq2Seq(cfg)
    assert isinstance(model.encoder[0].attn.kernel, fr.kernels.Softmax)
    assert isinstance(model.decoder[0].attn.kernel, fr.kernels.PRF) and model.decoder[0].attn.kernel.m == 16
    assert isinstance(model.decoder[0].cross.kernel, fr.kernels.EluPlusOne) and model.decoder[0].cross.kernel.normalize
    assert Seq2SeqConfig.from_json(cfg.to_json()) == cfg
    src, tgt = _copy_batch(B=8, S=6)
    losses = _train(model, lambda: model.loss(src, tgt), steps=12, lr=1e-2)
    assert losses[-1] < 0.8 * losses[0], losses
    model.eval()
    gen = model.generate(src[:3], max_len=7)
    seq = gen[:, :1]
    for _ in range(gen.shape[1] - 1):
        seq = torch.cat([seq, model(src[:3], seq)[:, -1].argmax(-1, keepdim=True)], 1)
    done = (gen == 2).cumsum(1) > 0
    keep = torch.cat([torch.ones_like(done[:, :1]), ~done[:, :-1]], 1)
    assert torch.equal(gen[keep], seq[keep])


def test_seq2seq_single_kernel_is_the_default_of_all_three():
    cfg = Seq2SeqConfig(vocab_size=12, d_model=32, n_heads=4, kernel="prf", num_features=8, cross_kernel="elu")
    assert cfg.kernels() == {"enc": ("prf", 8), "dec": ("prf", 8), "cross": ("elu", 8)}
    model = Seq2Seq(cfg)
    assert isinstance(model.encoder[0].attn.kernel, fr.kernels.PRF) and model.encoder[0].attn.kernel.m == 8
    assert isinstance(model.decoder[1].attn.kernel, fr.kernels.PRF)
    assert isinstance(model.decoder[1].cross.kernel, fr.kernels.EluPlusOne)


def test_seq2seq_with_shaw_in_every_attention_decodes():
    torch.manual_seed(0)
    model = Seq2Seq(Seq2SeqConfig(vocab_size=12, d_model=16, n_heads=2, n_enc_layers=1, n_dec_layers=1, kernel="elu",
                                  position="shaw", cross_position="shaw")).double()
    src, tgt = _copy_batch(B=2)
    memory, mask = model.encode(src)
    full = model.decode(tgt[:, :-1], memory, mask)
    logits, caches = model.step(tgt[:, :3], memory, mask, None)
    outs = [logits]
    for t in range(3, tgt.shape[1] - 1):
        logits, caches = model.step(tgt[:, t:t + 1], memory, mask, caches)
        outs.append(logits)
    torch.testing.assert_close(torch.cat(outs, 1), full)


def test_config_refuses_bad_feature_counts_and_kernels():
    with pytest.raises(ValueError, match="'dec_num_features' must be a positive int"):
        Seq2SeqConfig.from_dict({"dec_num_features": 0})
    with pytest.raises(ValueError, match="'enc_kernel' must be a kernel name"):
        Seq2SeqConfig.from_dict({"enc_kernel": 3})


def test_every_layer_draws_its_own_random_features_from_the_model_seed():
    cfg = Seq2SeqConfig(vocab_size=12, d_model=32, n_heads=4, kernel="prf", num_features=8)
    a, b = Seq2Seq(cfg), Seq2Seq(cfg)
    maps = [m for m in a.modules() if isinstance(m, fr.kernels.PRF)]
    assert len(maps) == 2 + 2 * 2  # encoder self, decoder self and cross
    ws = [m.w for m in maps]
    assert all(not torch.equal(x, y) for i, x in enumerate(ws) for y in ws[i + 1:])
    for x, y in zip(ws, [m.w for m in b.modules() if isinstance(m, fr.kernels.PRF)]):
        assert torch.equal(x, y)  # the same seed, the same draws
    c = Seq2Seq(Seq2SeqConfig(vocab_size=12, d_model=32, n_heads=4, kernel="prf", num_features=8, feature_seed=1))
    assert not torch.equal(maps[0].w, next(m for m in c.modules() if isinstance(m, fr.kernels.PRF)).w)
    lm = DecoderLM(LMConfig(vocab_size=12, d_model=32, n_heads=4, kernel="prf", num_features=8))
    w0, w1 = (blk.attn.kernel.w for blk in lm.blocks)
    assert not torch.equal(w0, w1)
    assert w0.shape == (4, 8, 8) and not torch.equal(w0[0], w0[1])  # and every head its own
