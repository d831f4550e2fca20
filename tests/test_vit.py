"""VisionTransformer: shapes on non-square images, every kernel with the 2D terms, the
fast backends against the dense reference, training on digits, patch permutation
(invariance without positions, sensitivity with them), config validation."""
from __future__ import annotations

import pytest
import torch

from fastrpe.data.images import load_images, patchify, unpatchify
from fastrpe.nn import ViTConfig, VisionTransformer
from fastrpe.positions.grid import FastRPB2D, Table2D


def _randomize_terms(model, scale=0.5, seed=0):
    """Give the (zero-initialized) 2D terms random values, so that they matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (Table2D, FastRPB2D)):
                for prm in m.parameters():
                    prm.copy_(scale * torch.randn(prm.shape, generator=g))


SHAPES = [((12, 20), 4, True), ((12, 20), 4, False), ((6, 3), 3, True), ((5, 7), 1, False)]


@pytest.mark.parametrize("position", ["none", "learned_abs", "sinusoidal2d", "table2d"])
@pytest.mark.parametrize("size,patch,cls", SHAPES, ids=[f"{h}x{w}-p{p}-{'cls' if c else 'mean'}" for (h, w), p, c in SHAPES])
def test_forward_shapes(size, patch, cls, position):
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=size, patch_size=patch, channels=2, num_classes=7, d_model=24, n_layers=2, n_heads=3,
                    position=position, fastrpb2d=True, cls_token=cls)
    model = VisionTransformer(cfg)
    assert model.grid == (size[0] // patch, size[1] // patch)
    tokens = model.embed(torch.rand(3, 2, *size))
    assert tokens.shape == (3, int(cls) + model.grid[0] * model.grid[1], 24)
    out = model(torch.rand(3, 2, *size))
    assert out.shape == (3, 7) and torch.isfinite(out).all()


KERNELS = ["softmax", "elu", "nprf"]


@pytest.mark.parametrize("cls", [True, False], ids=["cls", "mean"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_with_2d_terms_match_dense(kernel, cls):
    """auto (FFT grid ops) and the dense reference give the same logits and gradients,
    and the 2D terms get gradients."""
    torch.manual_seed(0)
    kw = dict(image_size=(9, 15), patch_size=3, d_model=16, n_layers=2, n_heads=2, kernel=kernel,
              position="table2d", fastrpb2d=True, cls_token=cls)
    fast = VisionTransformer(ViTConfig(**kw, backend="auto")).double()
    _randomize_terms(fast)
    dense = VisionTransformer(ViTConfig(**kw, backend="dense")).double()
    dense.load_state_dict(fast.state_dict())
    x = torch.rand(2, 1, 9, 15, dtype=torch.float64)
    outs = []
    for m in (fast, dense):
        y = m(x)
        y.pow(2).sum().backward()
        outs.append(y)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-10)
    for (name, pf), pd in zip(fast.named_parameters(), dense.parameters()):
        torch.testing.assert_close(pf.grad, pd.grad, rtol=1e-8, atol=1e-10, msg=name)
    terms = [list(blk.attn.positions) for blk in fast.blocks]
    assert [[type(t) for t in ts] for ts in terms] == [[Table2D, FastRPB2D]] * 2
    # every entry of the first layer's terms reaches the logits (in the last layer with a
    # class token, only the class token's row does)
    assert all(p.grad.abs().sum() > 0 for t in terms[0] for p in t.parameters())


@pytest.mark.parametrize("position,fastrpb2d,cls", [("table2d", True, True), ("none", True, False)],
                         ids=["table2d+fastrpb2d-cls", "fastrpb2d-mean"])
def test_trains_on_digits(position, fastrpb2d, cls):
    """8×8 digits in 2×2 patches (a 4×4 grid): 150 AdamW steps with a 30-step warm-up lower
    the loss on a fixed batch. (Without warm-up, some seeds sit on the initial plateau for
    ~200 steps, with or without the 2D terms: measured loss ratios 0.99-0.46 over seeds 0-4,
    against 0.35-0.55 with warm-up.)"""
    torch.manual_seed(0)
    ds = load_images("digits", "train")
    x, y = ds.images, ds.labels
    model = VisionTransformer(ViTConfig(image_size=8, patch_size=2, d_model=32, n_layers=2, n_heads=4,
                                        position=position, fastrpb2d=fastrpb2d, cls_token=cls))
    assert model.grid == (4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))

    def eval_loss():
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(x[:256]), y[:256]).item()

    before = eval_loss()
    for step in range(150):
        i = torch.randint(0, len(x), (64,), generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    after = eval_loss()
    assert after < 0.7 * before, (before, after)


def _shuffled_logits(model, x, perm, patch):
    """Logits of the images and of the same images with their patches moved (`perm`)."""
    pat = patchify(x, patch)
    x_perm = unpatchify(pat.patches[:, perm], pat.grid, patch)
    assert not torch.equal(x_perm, x)
    return model(x), model(x_perm)


def test_patch_permutation():
    """Mean pooling without positions cannot see where a patch is; Table2D and FastRPB2D can."""
    torch.manual_seed(0)
    x = torch.rand(4, 1, 8, 12, dtype=torch.float64)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(perm, torch.arange(6))
    kw = dict(image_size=(8, 12), patch_size=4, d_model=16, n_layers=2, n_heads=2, cls_token=False)
    plain = VisionTransformer(ViTConfig(**kw, position="none")).double().eval()
    a, b = _shuffled_logits(plain, x, perm, 4)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for variant in (dict(position="table2d"), dict(position="none", fastrpb2d=True)):
        torch.manual_seed(0)
        model = VisionTransformer(ViTConfig(**kw, **variant)).double().eval()
        _randomize_terms(model)
        a, b = _shuffled_logits(model, x, perm, 4)
        # the plain model is invariant to 1e-12 in float64: a change of 1e-6 is a real one
        assert (a - b).abs().max() > 1e-6, variant


def test_config_validation_and_json():
    cfg = ViTConfig(image_size=(8, 12), patch_size=4, position="table2d")
    back = ViTConfig.from_json(cfg.to_json())
    assert back == cfg and back.grid == (2, 3)
    with pytest.raises(ValueError, match="unknown field 'patch'"):
        ViTConfig.from_dict({"patch": 4})
    with pytest.raises(ValueError, match="'image_size'.*'patch_size'"):
        VisionTransformer(ViTConfig(image_size=(8, 10), patch_size=4))
    bad = [dict(position="rotary"), dict(image_size=(8,)), dict(image_size=0), dict(patch_size=0),
           dict(kernel="nope"), dict(cls_token=1), dict(d_model=30, n_heads=4)]
    names = ["position", "image_size", "image_size", "patch_size", "kernel", "cls_token", "d_model"]
    for kw, name in zip(bad, names):
        with pytest.raises(ValueError, match=f"'{name}'"):
            VisionTransformer(ViTConfig(**kw))
    with pytest.raises(ValueError, match=r"expected images \[B, 1, 8, 12\]"):
        VisionTransformer(cfg)(torch.rand(1, 1, 12, 8))
