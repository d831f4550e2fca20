"""Fused decode step (`ops/linear/triton_recurrent.py`): a prompt by the Triton chunked op,
then token-by-token steps, gives the full sequence's outputs from the dense reference
(`ops/linear/naive.py`, weights `γ^(i-j)`, j <= i). Interpreter set-up as in
test_triton_chunked.py.
"""

import pytest
import torch

_CUDA = torch.cuda.is_available()  # without it, conftest.py has set TRITON_INTERPRET=1
pytest.importorskip("triton")

from fastrpe._validate import FastRPEError  # noqa: E402
from fastrpe.ops.linear.naive import kernelized_num_den_naive  # noqa: E402
from fastrpe.ops.linear.triton_chunked import kernelized_num_den_triton_chunked, triton_unavailable_reason  # noqa: E402
from fastrpe.ops.linear.triton_recurrent import linear_step_triton  # noqa: E402
from fastrpe.testing import assert_close  # noqa: E402

DEV = torch.device("cuda" if _CUDA else "cpu")
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEV) is not None,
                                reason=str(triton_unavailable_reason(DEV)))


@pytest.mark.parametrize("F,Dv", [(12, 10), (20, 70)], ids=["F12-Dv10", "F20-Dv70-two-blocks"])
def test_prompt_then_steps_equal_full_pass(F, Dv):
    B, H, L, P = 2, 3, 21, 13  # P prompt tokens, then L - P single steps
    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(B, H, L, F, generator=g).to(DEV) for _ in range(2))
    v = torch.randn(B, H, L, Dv, generator=g).to(DEV)
    gamma = torch.tensor([0.6, 0.9, 1.0], device=DEV)
    r = torch.arange(-(L - 1), L, device=DEV, dtype=torch.float64)
    lc = r.abs()[None] * torch.log(gamma.double())[:, None]
    rn, rd, _ = kernelized_num_den_naive(q.double(), k.double(), v.double(), lc, causal=True)
    num, den, _, S = kernelized_num_den_triton_chunked(q[:, :, :P], k[:, :, :P], v[:, :, :P], gamma=gamma,
                                                       chunk_size=16, return_state=True)
    nums, dens = [num], [den]
    for t in range(P, L):
        n1, d1, S = linear_step_triton(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], S, gamma=gamma)
        nums.append(n1)
        dens.append(d1)
    assert_close(torch.cat(nums, 2), rn.float(), torch.float32)
    assert_close(torch.cat(dens, 2), rd.float(), torch.float32)


def test_step_refuses_more_than_one_token():
    x = torch.rand(1, 1, 2, 4, device=DEV)
    with pytest.raises(FastRPEError, match="one token"):
        linear_step_triton(x, x, x, torch.zeros(1, 1, 4, 5, device=DEV))
    with pytest.raises(FastRPEError, match="state"):
        linear_step_triton(x[:, :, :1], x[:, :, :1], x[:, :, :1], torch.zeros(1, 1, 4, 4, device=DEV))
