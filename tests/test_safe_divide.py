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


def test_quotient_is_safe_divide_in_place():
    """`quotient` (the Triton backends' forward division) is `safe_divide`'s value, empty rows
    0, in the dtype asked, scaling the caller's buffer in place."""
    from fastrpe.ops.common import quotient

    g = torch.Generator().manual_seed(2)
    num = torch.randn(2, 3, 9, 5, generator=g, dtype=torch.float64)
    den = torch.randn(2, 3, 9, generator=g, dtype=torch.float64)
    den[1, 0, 3] = 0.0
    buf = num.clone()
    out = quotient(buf, den, torch.float64)
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(out, safe_divide(num, den), rtol=0, atol=0)
    assert not out[1, 0, 3].any()
    assert quotient(num.clone(), den, torch.bfloat16).dtype == torch.bfloat16
