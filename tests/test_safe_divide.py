"""`safe_divide`'s hand-written backward against autograd through `num / den`."""
import torch

from fastrpe.ops.common import safe_divide


def test_safe_divide_forward_and_gradients_match_autograd():
    g = torch.Generator().manual_seed(0)
    num = torch.randn(2, 3, 7, 5, generator=g, dtype=torch.float64)
    den = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)  # negative rows included (Shaw)
    den[0, 1, 2] = 0.0  # an empty row
    den[1, 2, 4] = 1e-300  # below underflow_threshold: counts as empty
    w = torch.randn(num.shape, generator=g, dtype=torch.float64)
    n1, d1 = num.clone().requires_grad_(), den.clone().requires_grad_()
    out = safe_divide(n1, d1)
    dn, dd = torch.autograd.grad((out * w).sum(), (n1, d1))

    n2, d2 = num.clone().requires_grad_(), den.clone().requires_grad_()
    empty = torch.zeros_like(den, dtype=torch.bool)
    empty[0, 1, 2] = empty[1, 2, 4] = True
    ref = torch.where(empty[..., None], 0.0, n2 / torch.where(empty, 1.0, d2)[..., None])
    rn, rd = torch.autograd.grad((ref * w).sum(), (n2, d2))
    torch.testing.assert_close(out, ref, rtol=1e-15, atol=0)
    torch.testing.assert_close(dn, rn, rtol=1e-15, atol=0)
    torch.testing.assert_close(dd, rd, rtol=1e-14, atol=0)
    assert float(dd[0, 1, 2]) == 0.0 and float(dd[1, 2, 4]) == 0.0 and bool((out[0, 1, 2] == 0).all())


def test_safe_divide_gradcheck_and_second_order():
    g = torch.Generator().manual_seed(1)
    num = torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    den = (torch.rand(1, 2, 4, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(safe_divide, (num, den))
    assert torch.autograd.gradgradcheck(safe_divide, (num, den))


def test_quotient_and_its_gradients_in_row_blocks(monkeypatch):
    """`quotient` / `quotient_grads` (the Triton backends' division) against autograd through
    `num / den`: `dnum = dout·inv`, `dden = -inv·Σ dout·out`; empty rows 0 with no gradient;
    the row sums in blocks of one row (`QUOTIENT_BLOCK_BYTES`) as in one block."""
    from fastrpe.ops import common

    g = torch.Generator().manual_seed(2)
    num = torch.randn(2, 3, 9, 5, generator=g, dtype=torch.float64)
    den = torch.randn(2, 3, 9, generator=g, dtype=torch.float64)
    den[1, 0, 3] = 0.0
    dout = torch.randn(num.shape, generator=g, dtype=torch.float64)
    out = common.quotient(num.clone(), den, torch.float64)
    n, d = num.clone().requires_grad_(), den.clone().requires_grad_()
    empty = d.detach() == 0
    ref = torch.where(empty[..., None], 0.0, n / torch.where(empty, 1.0, d)[..., None])
    rn, rd = torch.autograd.grad((ref * dout).sum(), (n, d))
    torch.testing.assert_close(out, ref, rtol=1e-15, atol=0)
    for block in (None, 1):
        if block is not None:
            monkeypatch.setattr(common, "QUOTIENT_BLOCK_BYTES", block)
        inv, dd = common.quotient_grads(dout, out, den)
        torch.testing.assert_close(dout * inv[..., None], rn, rtol=1e-15, atol=0)
        torch.testing.assert_close(dd, rd, rtol=1e-13, atol=1e-15)
        assert float(dd[1, 0, 3]) == 0.0
    assert common.quotient(num.clone(), den, torch.bfloat16).dtype == torch.bfloat16
