"""Causal kernelized attention with geometric positional decay in linear time.

Chunk-parallel form (as in RetNet / flash-linear-attention's `chunk` kernels, written in
plain PyTorch): dense within a chunk, a running state `S = Σ_j γ^(t-j) φ(k_j) ⊗ [v_j, 1]`
of shape `[F, Dv+1]` carried across chunks. Weights `c(r) = γ^|r|` for `r <= 0`:
no positional term (γ = 1), ALiBi (γ = e^-m) and KERPLE power with p = 1 are exactly this.

Memory O(L·(F + Dv) + (L/C)·F·Dv): no per-position state is ever formed.

Notation: B batch, H heads, F features, C = Dv + 1 channels, T chunk length, n chunks.
"""
from __future__ import annotations

import torch
from torch import Tensor


DEFAULT_CHUNK = 64


def kernelized_num_den_chunked(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    *,
    gamma: Tensor | None = None,
    q_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    initial_state: Tensor | None = None,
    return_state: bool = False,
):
    """Causal `num`, `den` (and `log_scale`, all zeros) with weights `γ_h^(p_i - j)`, `j <= p_i`.

    Args:
        phi_q: `[B, H, Lq, F]` at positions `q_offset + 0..Lq-1`; phi_k: `[B, H, Lk, F]`; v: `[B, H, Lk, Dv]`.
        gamma: `[H]` decays in (0, 1] (differentiable), or None for 1.
        key_padding_mask: `[B, Lk]` bool, True = padding.
        chunk_size: T.
        initial_state: `[B, H, F, Dv+1]` state of keys before position 0 (decoding continues from it).
        return_state: also return the state after the last key (position Lk - 1).

    Returns:
        `(num [B, H, Lq, Dv], den [B, H, Lq], log_scale [H, Lq])` (+ `state` if asked).
    """
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dt = phi_q.dtype
    dev = phi_q.device
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    vv = torch.cat([v.to(dt), torch.ones_like(v[..., :1], dtype=dt)], dim=-1)  # (B, H, Lk, C)
    log_g = torch.zeros(H, dtype=dt, device=dev) if gamma is None else torch.log(gamma.to(dt))  # (H,)
    T = chunk_size
    end = max(Lk, q_offset + Lq)  # positions 0..end-1
    n = -(-end // T)
    P = n * T
    # place keys and queries on the position grid, zero-padded
    k_pos = torch.nn.functional.pad(phi_k, (0, 0, 0, P - Lk)).view(B, H, n, T, F)
    v_pos = torch.nn.functional.pad(vv, (0, 0, 0, P - Lk)).view(B, H, n, T, Dv + 1)
    q_pos = torch.nn.functional.pad(phi_q, (0, 0, q_offset, P - q_offset - Lq)).view(B, H, n, T, F)
    t = torch.arange(T, device=dev, dtype=dt)
    lg = log_g[:, None, None]  # (H, 1, 1)
    # within a chunk: γ^(s - u) for u <= s
    diff = t[:, None] - t[None, :]  # (T, T): s - u
    intra = torch.where(diff >= 0, torch.exp(lg * diff.clamp_min(0)), torch.zeros((), dtype=dt, device=dev))  # (H, T, T)
    a = torch.einsum("bhnsf,bhnuf->bhnsu", q_pos, k_pos) * intra[None, :, None]  # (B, H, n, T, T)
    y = torch.einsum("bhnsu,bhnuc->bhnsc", a, v_pos)  # (B, H, n, T, C)
    # chunk summaries: K_c = Σ_u γ^(T-1-u) φk_u ⊗ vv_u ; queries read the state decayed by γ^(s+1)
    to_end = torch.exp(lg[..., 0] * (T - 1 - t))  # (H, T)
    from_start = torch.exp(lg[..., 0] * (t + 1))  # (H, T)
    # two-operand contractions only: a three-operand einsum formed the [n, T, F, C] outer product
    kc = torch.einsum("bhnuf,bhnuc->bhnfc", k_pos * to_end[None, :, None, :, None], v_pos)  # (B, H, n, F, C)
    decay_T = torch.exp(log_g * T)[None, :, None, None]  # (1, H, 1, 1)
    S = torch.zeros(B, H, F, vv.shape[-1], dtype=dt, device=dev) if initial_state is None else initial_state.to(dt)
    inter = []
    for kc_c in kc.unbind(2):  # unbind, not kc[:, :, c]: each select's backward would zero-fill all of kc
        inter.append(S)
        S = decay_T * S + kc_c
    states = torch.stack(inter, dim=2)  # (B, H, n, F, C): state before each chunk
    y = y + torch.einsum("bhnsf,bhnfc->bhnsc", q_pos * from_start[None, :, None, :, None], states)
    y = y.reshape(B, H, P, -1)[:, :, q_offset: q_offset + Lq]
    out = (y[..., :Dv], y[..., Dv], torch.zeros(H, Lq, dtype=dt, device=dev))
    if return_state:
        # state after key Lk-1: S covers positions < P; remove the decay of the padded tail
        state = S * torch.exp(-log_g * (P - Lk))[None, :, None, None] if P > Lk else S
        return (*out, state)
    return out
