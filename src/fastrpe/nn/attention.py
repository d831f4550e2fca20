"""Multi-head attention layer: projections + `fastrpe.attention`, with a decode cache.

Notation: B batch, L/S query/key lengths, E embed dim, H heads, D = E / H.
"""
from __future__ import annotations

import weakref
from dataclasses import replace

import torch
from einops import rearrange
from torch import Tensor, nn
from torch.nn import functional as Fn
from torch.nn.modules import module as _nn_module

from .._validate import FastRPEError, check_backend_name, check_features, check_same_dtype
from ..api import attention
from ..dispatch import DecoderChoice, Problem, select_decoder
from ..kernels import get_kernel
from ..ops.linear.state import BandState, KVCache, LinearState, SoEState  # noqa: F401  (re-exported)
from ..positions.base import AdditiveTerm, Position


def rotary(x: Tensor, pos: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary position embedding (Su et al., "RoFormer", 2021) on `x: [B, H, L, D]` at positions `pos: [L]`."""
    D = x.shape[-1]
    half = D // 2
    inv = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / max(half, 1))
    ang = pos.to(torch.float32)[:, None] * inv[None, :]  # (L, D/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half: 2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


#: the fused q/k/v projection of a one-token decode step (`MultiheadAttention._fused_qkv`) is
#: kept while it takes at most this many bytes. It is a second copy of those weights, which saves
#: up to six launches a step (two matmuls, two casts, the ones of `[v, 1]`); above this size,
#: reading the weights takes longer than those launches
STEP_FUSE_MAX_BYTES = 16 << 20

#: when a one-token decode step with PRF features and a constant-size state runs as one Triton
#: kernel (`ops.linear.triton_recurrent`: `prf_linear_token_triton` for a geometric state,
#: `prf_band_token_triton` for a band, `prf_soe_token_triton` for a sum of exponentials:
#: features, state, quotient): "cuda" (default: on CUDA devices with triton), "always"
#: (wherever the kernels run, the interpreter included: the tests), "never" (the PyTorch ops,
#: 39 to 46 launches a step). The bench's decode section times both (`bench/gpu.py`, `decode_rows`).
FUSED_STEP = "cuda"

#: layer -> {name: (fingerprint, source tensors, value)}: what a one-token decode step would
#: rebuild from the parameters on every call (`MultiheadAttention._memoized`)
_STEP_MEMOS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fingerprint(tensors) -> tuple:
    """What identifies the values of `tensors` without reading them: the objects, their
    storage, version (in-place writes bump it), dtype, device and shape. Writes through
    `.data` bump no version and go unseen (as `fastrpe.ops.linear.soe`'s fit memo)."""
    return tuple((id(t), t.data_ptr(), t._version, t.dtype, t.device, t.shape) for t in tensors)


#: `step`'s cache types and the decode path each takes
_CACHE_KINDS = {LinearState: "linear", BandState: "band", SoEState: "soe", KVCache: "kv"}


def _state_fusable(state) -> bool:
    """A state the fused step takes: float32 tensors, `S` contiguous."""
    S = state.S
    return (S.dtype == torch.float32 and S.is_contiguous()
            and all(getattr(state, f).dtype == torch.float32 for f in ("keys", "values") if hasattr(state, f)))


def _plain_linears(*layers) -> bool:
    """Whether each layer is a plain `nn.Linear` and no forward hook, its own or a global one,
    would see a call (an adapter or a hook must: the fused step calls `Fn.linear` or a fused
    matmul instead)."""
    return (not (_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks)
            and all(type(p) is nn.Linear and not (p._forward_hooks or p._forward_pre_hooks) for p in layers))


def _identity_dropout(dropout: nn.Module, training: bool) -> bool:
    """Whether a layer's `nn.Dropout` changes nothing now (evaluating, or p = 0) and has no hook."""
    return (type(dropout) is nn.Dropout and (not training or dropout.p == 0)
            and not (dropout._forward_hooks or dropout._forward_pre_hooks))


def _state_in(state, dt: torch.dtype):
    """`state` with its tensors in `dt` (a state kept by a layer in another dtype)."""
    if state.S.dtype == dt:
        return state
    return replace(state, **{f: getattr(state, f).to(dt) for f in ("S", "keys", "values") if hasattr(state, f)})


class _FusedStep:
    """The constants of a fused one-token step (`MultiheadAttention._fused_step_plan`), built
    once per parameter state: the q/k/v matmul's `wt, bias` (`_fused_qkv`), the feature map's
    launch constants (`triton_recurrent.PRFStep`), a geometric state's decays `gamma [H]`, a
    band's log-coefficients `b [H, W+1]`, and the weights of the band or SoE steps by window
    length, made as steps need them (`weights`)."""

    __slots__ = ("_weights", "b", "bias", "gamma", "prf", "wt")

    def __init__(self, wt, bias, prf, gamma, b):
        self.wt, self.bias, self.prf, self.gamma, self.b = wt, bias, prf, gamma, b
        self._weights = {}

    def weights(self, key: tuple, build, sources: tuple = ()):
        """`build(n)` for a window of `n = key[-1]` keys, kept under `key` (at most 512 kept)
        with the `sources` whose `_fingerprint` the key holds (so that their ids stay theirs)."""
        hit = self._weights.get(key)
        if hit is None:
            if len(self._weights) >= 512:
                self._weights.clear()
            hit = self._weights[key] = (sources, build(key[-1]))
        return hit[1]


def _band_weights(b: Tensor, n: int, W: int) -> tuple[Tensor, Tensor | None]:
    """`(w [H, n], tail [H] or None)`: `recurrent.band_token_weights` as the fused step reads them."""
    from ..ops.linear import recurrent

    w, tail, _ = recurrent.band_token_weights(b, n, W)
    return w.contiguous(), (None if tail is None else tail.reshape(-1).contiguous())


def _soe_weights(plan, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """`(gamma [K], a [H, K], cw [H, n])`: `recurrent.soe_token_coefficients` in float32, as the
    fused step reads them."""
    from ..ops.linear import recurrent

    gamma, a, cw = recurrent.soe_token_coefficients(plan, n, torch.float32)
    H = a.shape[0]
    return gamma.reshape(-1).contiguous(), a.reshape(H, -1).contiguous(), cw.contiguous()


def group_size(group) -> int:
    """Ranks in a context-parallel `group` (1 for None). Raises `FastRPEError` for anything
    that is not a `torch.distributed` process group of an initialized world."""
    if group is None:
        return 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise FastRPEError("group: a process group needs torch.distributed initialized (init_process_group)")
    if not isinstance(group, dist.ProcessGroup):
        raise FastRPEError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return dist.get_world_size(group)


def global_offset(length: int, group, device) -> int:
    """Global position of this rank's first token in `group` (rank order is sequence order),
    from every rank's slice `length` (one all-gather of an integer)."""
    from ..distributed import comm

    lengths = comm.slice_lengths(length, group, device if device.type == "cuda" else None)
    return comm.global_offset(lengths, comm.world(group)[0])


class MultiheadAttention(nn.Module):
    """Multi-head attention with a relative positional term and any content kernel.

    Args:
        embed_dim: model width E.
        num_heads: H; E must be divisible by H.
        kernel: "softmax", a feature-map name or a `fastrpe.kernels` object (see `fastrpe.attention`).
        position: a positional term (or list of terms) with `num_heads == H`, or None.
        causal: mask future keys.
        dropout: dropout on the attention output before the output projection (the same for
            every backend; kernelized backends never form the weights to drop).
        batch_first: inputs `[B, L, E]` if True (default), else `[L, B, E]`.
        bias: biases in the projections.
        kdim, vdim: key/value input widths (default E).
        rotary: apply rotary embeddings to q and k (an absolute-position baseline).
        backend: passed to `fastrpe.attention` ("auto" by default).
        group: a `torch.distributed` process group for context parallelism, or None. With more
            than one rank, `forward` takes this rank's contiguous slice of the sequence (rank
            order is sequence order) and returns its slice of the output: self-attention runs
            through `fastrpe.distributed.attention` across the group, rotary positions are
            the slice's global positions; projections and dropout are local.

    Unlike `torch.nn.MultiheadAttention`, `forward` returns only the output tensor.

    Example:
        >>> import torch, fastrpe as fr
        >>> mha = fr.nn.MultiheadAttention(64, 4, kernel="nprf", position=fr.positions.KerpleLog(4), causal=True)
        >>> mha(torch.randn(2, 100, 64)).shape
        torch.Size([2, 100, 64])
    """

    def __init__(self, embed_dim: int, num_heads: int, kernel="softmax", position=None, *, causal: bool = False,
                 dropout: float = 0.0, batch_first: bool = True, bias: bool = True, kdim: int | None = None,
                 vdim: int | None = None, rotary: bool = False, backend: str = "auto", group=None):
        super().__init__()
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads), ("kdim", kdim), ("vdim", vdim)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val <= 0):
                raise FastRPEError(f"MultiheadAttention: {name} must be a positive int, got {val!r}")
        if embed_dim % num_heads:
            raise FastRPEError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
            raise FastRPEError(f"MultiheadAttention: dropout must be in [0, 1), got {dropout!r}")
        for name, val in (("causal", causal), ("batch_first", batch_first), ("bias", bias), ("rotary", rotary)):
            if not isinstance(val, bool):
                raise FastRPEError(f"MultiheadAttention: {name} must be a bool, got {val!r}")
        check_backend_name(backend, "MultiheadAttention: backend")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.batch_first, self.backend, self.rotary = causal, batch_first, backend, rotary
        # a FeatureMap is a module (random projections are buffers) and registers itself here
        self.kernel = get_kernel(kernel, head_dim=self.head_dim)
        terms = [] if position is None else (list(position) if isinstance(position, (list, tuple)) else [position])
        for t in terms:
            if not isinstance(t, (Position, AdditiveTerm)):
                raise TypeError(f"position: expected fastrpe positional terms, got {type(t).__name__}")
            if t.num_heads != num_heads:
                raise ValueError(f"position: {type(t).__name__} has num_heads={t.num_heads}, layer has {num_heads}")
        self.positions = nn.ModuleList(terms)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(kdim or embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(vdim or embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.group = group

    @property
    def group(self):
        """The context-parallel process group (None: the whole sequence is on this process)."""
        return self._group

    @group.setter
    def group(self, group) -> None:
        self._cp = group_size(group)
        self._group = group

    @property
    def position(self):
        """The positional term(s) as given to `fastrpe.attention`."""
        t = list(self.positions)
        return None if not t else (t[0] if len(t) == 1 else t)

    def _check_input(self, x, name: str, width: int, where: str) -> None:
        """`x: [B, L, width]` (`[L, B, width]` when not batch_first), floating, in the weights' dtype."""
        layout = "[B, L, E]" if self.batch_first else "[L, B, E]"
        check_features(x, name, width, where, layout=layout)
        check_same_dtype(x, self.q_proj.weight, name, where)

    def _heads(self, x: Tensor) -> Tensor:
        return rearrange(x, "b l (h d) -> b h l d", h=self.num_heads)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, q_offset: int | None, key_padding_mask: Tensor | None) -> Tensor:
        if self._cp > 1:
            return self._attend_parallel(q, k, v, key_padding_mask)
        if self.rotary:
            Lq, Lk = q.shape[2], k.shape[2]
            off = q_offset if q_offset is not None else (Lk - Lq if self.causal and Lq < Lk else 0)
            q = rotary(q, torch.arange(off, off + Lq, device=q.device))
            k = rotary(k, torch.arange(Lk, device=k.device))
        o = attention(q, k, v, kernel=self.kernel, position=self.position, causal=self.causal, q_offset=q_offset,
                      key_padding_mask=key_padding_mask, backend=self.backend)  # (B, H, L, D)
        return self.out_proj(self.dropout(rearrange(o, "b h l d -> b l (h d)")))

    def _attend_parallel(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        """`_attend` on this rank's slice of the sequence, across the context-parallel group."""
        from .. import distributed

        if self.rotary:
            off = global_offset(q.shape[2], self.group, q.device)
            pos = torch.arange(off, off + q.shape[2], device=q.device)
            q, k = rotary(q, pos), rotary(k, pos)
        o = distributed.attention(q, k, v, kernel=self.kernel, position=self.position, causal=self.causal,
                                  key_padding_mask=key_padding_mask, backend=self.backend,
                                  group=self.group)  # (B, H, L, D): this rank's rows
        return self.out_proj(self.dropout(rearrange(o, "b h l d -> b l (h d)")))

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, q_offset: int | None = None) -> Tensor:
        """Args: `query: [B, L, E]`, `key`/`value: [B, S, kdim/vdim]` (default: query — self-attention),
        `key_padding_mask: [B, S]` bool (True = padding). Returns `[B, L, E]` (or `[L, B, E]`)."""
        if self._cp > 1 and (key is not None or value is not None):
            raise FastRPEError("MultiheadAttention: with a context-parallel group, only self-attention "
                               "(key=None, value=None) is supported")
        if self._cp > 1 and q_offset is not None:
            raise FastRPEError("MultiheadAttention: q_offset must be None with a context-parallel group "
                               "(each rank's slice is at its global position)")
        key = query if key is None else key
        value = key if value is None else value
        self._check_input(query, "query", self.embed_dim, "MultiheadAttention")
        self._check_input(key, "key", self.k_proj.in_features, "MultiheadAttention")
        self._check_input(value, "value", self.v_proj.in_features, "MultiheadAttention")
        b = 0 if self.batch_first else 1
        if not query.shape[b] == key.shape[b] == value.shape[b]:
            raise FastRPEError(f"MultiheadAttention: batch sizes differ: query {query.shape[b]}, key {key.shape[b]}, "
                               f"value {value.shape[b]}")
        if key.shape[1 - b] != value.shape[1 - b]:
            raise FastRPEError(f"MultiheadAttention: key has {key.shape[1 - b]} positions, value {value.shape[1 - b]}")
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        q = self._heads(self.q_proj(query))  # (B, H, L, D)
        k = self._heads(self.k_proj(key))  # (B, H, S, D)
        v = self._heads(self.v_proj(value))  # (B, H, S, D)
        o = self._attend(q, k, v, q_offset, key_padding_mask)
        return o if self.batch_first else o.transpose(0, 1)

    def decoder(self, length: int = 1) -> DecoderChoice:
        """Which state `step` keeps for sequences up to `length` tokens, chosen by
        `fastrpe.dispatch.select_decoder` from the kernel, the terms and the layer's backend,
        with the reasons the constant-size states were refused (`print()` it)."""
        w = self.q_proj.weight
        pos = [t for t in self.positions if isinstance(t, Position)]
        add = tuple(t for t in self.positions if isinstance(t, AdditiveTerm))
        p = Problem(1, self.num_heads, 1, max(int(length), 1), self.head_dim, self.head_dim, w.dtype, w.device,
                    self.kernel, pos[0] if pos else None, add, self.causal, 0, False, False)
        return select_decoder(p, self.backend)

    @property
    def decode_state(self) -> str:
        """What `step` keeps between calls: "linear" (a constant-size `LinearState`: no
        positional term or a geometric decay), "band" (a constant-size `BandState`: a
        finite-support term such as T5), "soe" (a constant-size `SoEState`: backend "soe",
        approximate like that backend) or "kv" (a `KVCache`: exact for everything). See `decoder`."""
        return self.decoder().name

    @property
    def recurrent_decoding(self) -> bool:
        """True when `step` keeps a constant-size state instead of a KV cache."""
        return self.decode_state != "kv"

    def _step_state(self, x: Tensor, state, kind: str, max_length: int | None):
        """One decode call with a constant-size state: the decode op of `kind`, run like the
        forward pass (autocast off, features in float32/64, output back in x's dtype)."""
        start, L = (0 if state is None else state.length), x.shape[1]
        if L == 1 and state is not None and not self.rotary and not torch.is_grad_enabled() \
                and not torch.compiler.is_compiling():
            o, new = self._step_token(x, state, kind)
            return (o if self.batch_first else o.transpose(0, 1)), new
        from ..ops.common import safe_divide
        from ..ops.linear import recurrent
        from ..ops.linear.soe import causal_log_coefficients, soe_extend, soe_plan_for

        q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        if self.rotary:
            pos = torch.arange(start, start + L, device=x.device)
            q, k = rotary(q, pos), rotary(k, pos)
        term = self.position
        with torch.autocast(x.device.type, enabled=False):
            phi_q, phi_k = self.kernel(q, is_query=True), self.kernel(k, is_query=False)  # (B, H, L, F)
            v = v.to(phi_q.dtype)
            if kind == "linear":
                gamma = term.geometric_decay() if term is not None else None
                num, den, new = recurrent.linear_step(phi_q, phi_k, v, state, gamma=gamma)
            elif kind == "band":
                W = term.finite_support()
                b = causal_log_coefficients(term, W + 1).to(phi_q.dtype)  # (H, W+1): b(-d), d = 0..W
                num, den, _, new = recurrent.band_step(phi_q, phi_k, v, state, b=b, window=W)
            else:
                if state is None:
                    plan = soe_plan_for(term, max(L, max_length or 0))
                else:
                    plan, why = soe_extend(state.plan, term, start + L)
                    if why:
                        raise FastRPEError(f"step: backend={self.backend!r} cannot decode past {state.plan.fit_length} "
                                           f"tokens: {why} (pass max_length= to the first step to fit for longer)")
                num, den, new = recurrent.soe_step(phi_q, phi_k, v, state, plan=plan)
            o = safe_divide(num, den).to(x.dtype)  # (B, H, L, D)
        o = self.out_proj(self.dropout(rearrange(o, "b h l d -> b l (h d)")))
        return (o if self.batch_first else o.transpose(0, 1)), new

    def _step_token(self, x: Tensor, state, kind: str):
        """`_step_state` for one token `x: [B, 1, E]` after a state, without autograd: the
        same result in fewer launches (`benchmarks/decode_ops.py` counts them). The q/k/v
        projections are one matmul that also emits the 1 of `[v, 1]` (`_fused_qkv`), cast
        once to the features' dtype; the per-head constants (decays, band weights, the fit's
        coefficients) are built once per parameter state (`_memoized`); the ops are
        `recurrent`'s `*_token` bodies, or one Triton kernel for PRF features (`_prf_step`)."""
        plan = self._fused_step_plan(x, state, kind)
        if plan is not None:
            return self._prf_step(x, state, kind, plan)
        from ..ops.linear import recurrent

        B, H, D, E = x.shape[0], self.num_heads, self.head_dim, self.embed_dim
        fused = self._fused_qkv()
        if fused is not None:
            wt, bias = fused
            qkv = torch.addmm(bias, x.view(B, E), wt)  # (B, 2E + H(D+1))
        with torch.autocast(x.device.type, enabled=False):
            # with one token, [B, (h d)] is [B, h, 1, d] in memory: the head split is a view
            if fused is not None:
                qkv = qkv.float() if qkv.dtype in (torch.float16, torch.bfloat16) else qkv  # as the feature maps
                q, k = qkv[..., :E].view(B, H, 1, D), qkv[..., E:2 * E].view(B, H, 1, D)
                vv = qkv[..., 2 * E:].view(B, H, 1, D + 1)  # [v, 1]
            else:
                q, k, v = (p(x).view(B, H, 1, D) for p in (self.q_proj, self.k_proj, self.v_proj))
            phi_q, phi_k = self.kernel(q, is_query=True), self.kernel(k, is_query=False)  # (B, H, 1, F)
            dt = phi_q.dtype
            vv = vv.to(dt) if fused is not None else recurrent._vv(v, dt)  # (B, H, 1, C)
            state = _state_in(state, dt)
            if kind == "linear":
                y, S = recurrent.linear_token(phi_q, phi_k, vv, state.S, self._step_decay(x.device, dt))
                new = LinearState(S, state.length + 1)
            elif kind == "band":
                state, (w, tail) = self._band_constants(state, dt)
                y, new = recurrent.band_token(phi_q, phi_k, vv, state, w, tail)
            else:
                state, coeffs = self._soe_constants(state, dt)
                y, new = recurrent.soe_token(phi_q, phi_k, vv, state, *coeffs)
            o = recurrent.divide_packed(y).to(x.dtype)  # (B, H, 1, D)
        return self.out_proj(self.dropout(o.reshape(B, 1, E))), new

    def _band_constants(self, state: BandState, dt: torch.dtype):
        """`(state with the term's window, (w [H, n], tail [H, 1] or None))`: the weights of a
        one-token band step over `n = state.keys.shape[2] + 1` keys in `dt`
        (`recurrent.band_token_weights`), built once per parameter state and n (`_memoized`)."""
        from ..ops.linear import recurrent
        from ..ops.linear.soe import causal_log_coefficients

        term = self.position
        W, n = term.finite_support(), state.keys.shape[2] + 1
        b = self._memoized("band_b", self._tensors(term), (W, dt),
                           lambda: causal_log_coefficients(term, W + 1).to(dt))  # (H, W+1)
        w, tail, _ = self._memoized("band_w", [b], n, lambda: recurrent.band_token_weights(b, n, W))
        return replace(state, window=W), (w, tail)

    def _soe_constants(self, state: SoEState, dt: torch.dtype):
        """`(state with its plan checked one token further, (gamma [K, 1, 1], a [H, K, 1],
        cw [H, n]))`: `recurrent.soe_token_coefficients` over `n = state.keys.shape[2] + 1`
        keys in `dt`, built once per plan and n (`_memoized`)."""
        from ..ops.linear import recurrent

        state = self._soe_state_extended(state)
        plan, n = state.plan, state.keys.shape[2] + 1
        coeffs = self._memoized("soe", [plan.gamma, plan.a, plan.corr], (n, dt),
                                lambda: recurrent.soe_token_coefficients(plan, n, dt))
        return state, coeffs

    def _soe_state_extended(self, state: SoEState) -> SoEState:
        """`state` with its plan checked one token further (`soe_extend`: the same plan within
        its fit length; past it, a longer one if the fit still holds), or a one-line refusal."""
        from ..ops.linear.soe import soe_extend

        plan, why = soe_extend(state.plan, self.position, state.length + 1)
        if why:
            raise FastRPEError(f"step: backend={self.backend!r} cannot decode past {state.plan.fit_length} "
                               f"tokens: {why} (pass max_length= to the first step to fit for longer)")
        return state if plan is state.plan else replace(state, plan=plan)

    def _prf_step_fusable(self, x: Tensor, state) -> bool:
        """Whether `_prf_step` runs this step (`FUSED_STEP`): PRF features exactly (a subclass
        may change them), float32 features and state (a contiguous `S`), the kernels available
        on x's device."""
        from ..kernels import PRF
        from ..ops.linear.triton_chunked import triton_route

        return (triton_route(FUSED_STEP, "fastrpe.nn.attention.FUSED_STEP", x.device)
                and type(self.kernel) is PRF and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and _state_fusable(state))

    def _fused_step_plan(self, x: Tensor, state, kind: str):
        """What `_prf_step` reads besides x and the state (a `_FusedStep`), or None where it does
        not run (`_prf_step_fusable`, `_fused_qkv`). One memo (`_memoized`) over every tensor it
        comes from, so a step checks one fingerprint; the checks that a call can change without
        touching a tensor (a hook added, a state's dtype, a feature map's setting) run every
        step. Modules and tensors are read from their modules' dicts (`nn.Module.__getattr__`,
        a microsecond each, was a quarter of the step's host time): a token's host time is most
        of an eager step's on a GPU (`benchmarks/decode_ops.py --host`)."""
        if FUSED_STEP == "never" or (FUSED_STEP == "cuda" and not x.is_cuda):  # (the PyTorch ops' own cost)
            return None
        mods = self._modules
        q, k, v, kern = mods["q_proj"], mods["k_proj"], mods["v_proj"], mods.get("kernel")
        if not _state_fusable(state) or not _plain_linears(q, k, v):
            return None
        w = None if kern is None else kern._buffers.get("w")
        if not isinstance(w, Tensor):  # a feature map without random projections: not PRF
            self._prf_step_fusable(x, state)  # (a FUSED_STEP that is none of its values still raises)
            return None
        sources = [t for p in (q, k, v) for t in p._parameters.values() if t is not None]
        sources.append(w)
        terms = list(mods["positions"]._modules.values())
        if kind != "soe":  # a geometric state's decays, a band's weights
            for term in terms:
                sources += self._tensors(term)
        a = kern.__dict__
        extra = (kind, x.dtype, x.device, FUSED_STEP, STEP_FUSE_MAX_BYTES, type(kern), a.get("normalize"),
                 a.get("input_scale"), a.get("two_sided"), terms[0].finite_support() if kind == "band" else None)
        return self._memoized("fused_step", sources, extra, lambda: self._build_fused_step(x, state, kind))

    def _build_fused_step(self, x: Tensor, state, kind: str):
        """`_fused_step_plan`'s value, built (None where the fused step does not apply)."""
        from ..ops.linear import triton_recurrent

        fused = self._fused_qkv() if self._prf_step_fusable(x, state) else None
        if fused is None:
            return None
        H, D, kern = self.num_heads, self.head_dim, self.kernel
        shift = kern.key_log_shift().to(device=x.device, dtype=torch.float32).reshape(-1).expand(H)
        prf = triton_recurrent.prf_step(kern.w.to(torch.float32).contiguous(), shift.contiguous(), H, D,
                                        input_scale=kern.input_scale, normalize=kern.normalize,
                                        two_sided=kern.two_sided, out_dtype=x.dtype)
        gamma = None
        if kind == "linear":
            g = self._step_decay(x.device, torch.float32)
            gamma = None if g is None else g.view(H)
        b = None
        if kind == "band":
            from ..ops.linear.soe import causal_log_coefficients

            term = self.position
            b = causal_log_coefficients(term, term.finite_support() + 1).to(torch.float32)  # (H, W+1): b(-d)
        return _FusedStep(*fused, prf, gamma, b)

    def _prf_step(self, x: Tensor, state, kind: str, plan: _FusedStep):
        """One token after a constant-size state of `kind` in one Triton launch between the
        q/k/v matmul and the output projection (`ops.linear.triton_recurrent`'s
        `prf_*_token_packed`: PRF's features, the state's update and `num/den`); the same
        result as the ops of `_step_token`, with the same constants in float32 (`plan`:
        `_fused_step_plan`'s; a band's and a sum of exponentials' weights for this step's
        window, `_FusedStep.weights`)."""
        from ..ops.linear import triton_recurrent

        B, E = x.shape[0], self.embed_dim
        qkv = torch.addmm(plan.bias, x.view(B, E), plan.wt)  # (B, 2E + H(D+1)): [q, k, [v, 1]]
        if kind == "linear":
            o, S = triton_recurrent.prf_linear_token_packed(plan.prf, qkv, state.S, plan.gamma)
            new = LinearState(S, state.length + 1)
        elif kind == "band":
            W = plan.b.shape[1] - 1
            bw, tail = plan.weights(("band", state.keys.shape[2] + 1),
                                    lambda n: _band_weights(plan.b, n, W))
            o, new = triton_recurrent.prf_band_token_packed(plan.prf, qkv, state, bw, tail, W)
        else:
            if state.length + 1 > state.plan.fit_length:  # decoding past the fit: checked, the plan extended
                state = self._soe_state_extended(state)
            sp, n = state.plan, state.keys.shape[2] + 1
            src = (sp.gamma, sp.a, sp.corr)
            gamma, a, cw = plan.weights(("soe", _fingerprint(src), n), lambda n: _soe_weights(sp, n), src)
            o, new = triton_recurrent.prf_soe_token_packed(plan.prf, qkv, state, gamma, a, cw)
        mods = self._modules
        out, dropout = mods["out_proj"], mods["dropout"]
        o = o.view(B, 1, E)
        if _plain_linears(out) and _identity_dropout(dropout, self.training):
            p = out._parameters
            return Fn.linear(o, p["weight"], p["bias"]), new
        return out(dropout(o)), new

    def _step_decay(self, device: torch.device, dt: torch.dtype) -> Tensor | None:
        """The geometric state's per-head decay `[H, 1, 1]` in `dt` (None without a term or a
        decay), built once per parameter state (`_memoized`)."""
        term = self.position
        if term is None:
            return None

        def decay():
            g = term.geometric_decay()
            return None if g is None else g.to(device=device, dtype=dt)[:, None, None]

        return self._memoized("gamma", self._tensors(term), (dt, device), decay)

    @staticmethod
    def _tensors(module: nn.Module) -> list:
        if not module._modules:  # a leaf (a positional term): its own tensors, without the generators' walk
            return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        return list(module.parameters()) + list(module.buffers())

    def _memoized(self, name: str, sources, extra, build):
        """`build()`, kept for this layer until a tensor in `sources` or `extra` changes (see
        `_fingerprint`). Decoding without autograd only: the value is built outside any graph."""
        memo = _STEP_MEMOS.get(self)
        if memo is None:
            memo = _STEP_MEMOS[self] = {}
        key = (_fingerprint(sources), extra)
        hit = memo.get(name)
        if hit is None or hit[0] != key:
            hit = memo[name] = (key, tuple(sources), build())  # the sources are held: their ids stay theirs
        return hit[2]

    def _fused_qkv(self):
        """`(weight.T [E, 2E + H(D+1)], bias [2E + H(D+1)])`: the q, k and v projections in one
        matrix, each head's v rows followed by a zero row with bias 1, so that `x @ weight.T +
        bias` is `[q, k, [v, 1]]` (the denominator's column of the state comes out of the
        matmul). None if it would take more than `STEP_FUSE_MAX_BYTES`, or if a projection is
        not a plain `nn.Linear` without hooks (an adapter or a hook must see its call)."""
        H, D, E = self.num_heads, self.head_dim, self.embed_dim
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if not _plain_linears(*projs):
            return None
        w = self.q_proj.weight
        if (2 * E + H * (D + 1)) * (E + 1) * w.element_size() > STEP_FUSE_MAX_BYTES:
            return None

        def build():
            bias = [w.new_zeros(E) if p.bias is None else p.bias for p in projs]
            wv = torch.cat([self.v_proj.weight.view(H, D, E), w.new_zeros(H, 1, E)], 1).view(H * (D + 1), E)
            bv = torch.cat([bias[2].view(H, D), w.new_ones(H, 1)], 1).view(H * (D + 1))
            wt = torch.cat([self.q_proj.weight, self.k_proj.weight, wv]).t().contiguous()
            return wt, torch.cat([bias[0], bias[1], bv])

        return self._memoized("qkv", [t for p in projs for t in (p.weight, p.bias) if t is not None], None, build)

    def step(self, x: Tensor, cache: KVCache | LinearState | BandState | SoEState | None = None, *,
             max_length: int | None = None):
        """Causal self-attention decoding: `x: [B, L, E]` new tokens (a prompt, or one token).

        Returns the output for the new tokens and the cache extended by them: a `KVCache`
        (exact for every positional term, O(L) per step) or a constant-size `LinearState`,
        `BandState` or `SoEState`, as `decoder()` chooses on the first call (`cache=None`).
        Calling `step` on a prompt and then token by token gives the same outputs as
        `forward` on the whole sequence.

        Args:
            max_length: the longest sequence this decoding will reach (first call only): the
                `soe` state is fitted for it (default: the prompt, at least 4,096 tokens; past
                its fit the state is checked and refused with the measured error if worse).
        """
        if not self.causal:
            raise FastRPEError("step() decodes causal self-attention; this layer has causal=False")
        if self._cp > 1:
            raise FastRPEError("MultiheadAttention.step: decoding is not context-parallel; set group=None "
                               "on a copy of the layer to decode")
        self._check_input(x, "x", self.embed_dim, "MultiheadAttention.step")
        kin, vin = self._modules["k_proj"].in_features, self._modules["v_proj"].in_features  # (no __getattr__: per token)
        if kin != self.embed_dim or vin != self.embed_dim:
            raise FastRPEError("MultiheadAttention.step: decodes self-attention, but this layer has kdim/vdim "
                               f"({kin}/{vin}) != embed_dim ({self.embed_dim})")
        if isinstance(cache, KVCache) and cache.k is not None and cache.k.shape[0] != x.shape[0 if self.batch_first else 1]:
            raise FastRPEError(f"MultiheadAttention.step: x has batch {x.shape[0 if self.batch_first else 1]}, "
                               f"the cache {cache.k.shape[0]}")
        if not self.batch_first:
            x = x.transpose(0, 1)
        if cache is None:
            choice = self.decoder(max(x.shape[1], max_length or 0))
            if choice.fatal:
                raise FastRPEError(f"step: backend={self.backend!r} cannot decode with this term: {choice.fatal}")
            kind = choice.name
        else:
            kind = _CACHE_KINDS.get(type(cache))
            if kind is None:
                raise FastRPEError(f"MultiheadAttention.step: cache must be None, a KVCache, LinearState, BandState "
                                   f"or SoEState (what step returned), got {type(cache).__name__}")
        if kind != "kv":
            return self._step_state(x, cache, kind, max_length)
        cache = cache or KVCache()
        k, v = self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        if cache.k is not None:
            k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        q = self._heads(self.q_proj(x))
        o = self._attend(q, k, v, cache.length, None)
        o = o if self.batch_first else o.transpose(0, 1)
        return o, KVCache(k, v)
