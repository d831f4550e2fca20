"""Row-wise accuracy of the exact fast paths against a float64 dense reference.

FFT round-off is relative to the largest value in a product, so rows whose weights are
all tiny could lose every digit; every row of every exact backend must stay within 1e-4
relative error at L = 4,096 in float32, for sharp decays and large table swings.
"""
from __future__ import annotations

import pytest
import torch

import fastrpe as fr
from fastrpe import positions as P

L, H, D = 4096, 1, 16
ROW_RTOL = 1e-4


def _sharp(name: str):
    g = torch.Generator().manual_seed(1)
    if name == "kerple_power_r1=2_p=2":
        return P.KerplePower(H, r1=2.0, p=1.999)  # p < 2 strictly by construction
    if name == "alibi_slope_1":
        a = P.ALiBi(H)
        a.slopes.fill_(1.0)
        return a
    t = P.LearnedTable(H, max_distance=L)
    with torch.no_grad():
        t.table.copy_(torch.rand(H, 2 * L + 1, generator=g) * 60 - 30)  # entries in [-30, 30]
    return t


CASES = [(n, c, b) for n in ("kerple_power_r1=2_p=2", "alibi_slope_1", "table_-30_30") for c in (False, True)
         for b in ("fft",) + (("chunked",) if n == "alibi_slope_1" and c else ())]


@pytest.mark.parametrize("name,causal,backend", CASES, ids=[f"{n}-{'causal' if c else 'full'}-{b}" for n, c, b in CASES])
def test_every_row_within_1e4_of_float64(name, causal, backend):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    pos = _sharp(name)
    with torch.no_grad():
        ref = fr.attention(q, k, v, kernel="elu", position=pos.double(), causal=causal, backend="dense")
        out = fr.attention(q.float(), k.float(), v.float(), kernel="elu", position=pos.float(), causal=causal,
                           backend=backend)
    rel = (out.double() - ref).norm(dim=-1) / ref.norm(dim=-1)  # (1, H, L): one number per row
    worst = rel.argmax().item()
    assert rel.max().item() < ROW_RTOL, f"row {worst}: relative error {rel.max().item():.2e}"
