"""Triton kernels for causal kernelized attention with a per-head geometric decay
`c(r) = γ_h^|r|`, forward and backward (the fast sibling of `chunked.py`; the dense
reference is `naive.py`).

Chunk-parallel form, as flash-linear-attention's `chunk` kernels: five kernels, two of
them sequential over chunks and light (the states), three parallel over chunks and heavy
(the outputs and the gradients):

  1. `_fwd_state`:  S_{n+1} = γ^(e_n - e_{n-1}) S_n + Σ_{u in chunk n} γ^(e_n - 1 - u) φk_u ⊗ [v_u, 1]
  2. `_fwd_out`:    y_s = γ^(s + 1 - e_{n-1}) φq_s S_n + Σ_{u <= s} γ^(s - u) (φq_s·φk_u) [v_u, 1]
  3. `_bwd_state`:  dS_n = γ^(e_n - e_{n-1}) dS_{n+1} + Σ_s γ^(s + 1 - e_{n-1}) φq_s ⊗ dy_s
  4. `_bwd_dkv`:    dφk, dv of each chunk from dS_{n+1}; then the dS are freed
  5. `_bwd_dq`:     dφq of each chunk from S_n

(4 and 5 were one kernel: apart, the states' gradients and dφq are never held together,
and each kernel holds fewer registers.)

where `e_n = min((n+1)·T, Lk)`: the state after chunk n holds the keys before e_n,
relative to key e_n - 1, so the last state is exactly the state after key Lk - 1 (no
division by a decay that may underflow). Every decay factor is `exp(log γ · d)` with
`d >= 0`: nothing overflows, whatever γ. The denominator rides along as the state's
extra column `z` (the value 1), kept apart from the `[F, Dv]` tiles so that `tl.dot`
sees power-of-two widths.

The gradient of `log γ` needs no kernel: every weight is `γ^(p_i - j)`, so
`d/d log γ = Σ_pairs (p_i - j)·w_ij·(φq_i·φk_j)(dy_i·[v_j, 1])`, computed as chunk-local
position sums of `φq·dφq` and `φk·dφk` plus `T·Σ_b <S_b, dS_b>` over chunk boundaries (no
cancellation between terms L·(1-γ) times larger than the result).

Inputs bf16/fp16/fp32/fp64; accumulation in fp32 (fp64 for fp64 inputs). On the GPU the
`tl.dot` operands are in the input dtype (bf16 tensor cores; float32 exactly, or by three
tf32 products with `precision="tf32x3"`); the interpreter
(`TRITON_INTERPRET=1`, the CPU tests) computes bf16 dots wrongly in triton 3.9, so there
the operands are rounded to the input dtype and multiplied in the accumulation dtype.

Notation: B batch, H heads, Lq/Lk lengths, F features, Dv value width, T (BT) chunk
length, N chunks, BF/BV/BDV power-of-two tile widths (>= 16 for `tl.dot`).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch import Tensor

from ..._validate import FastRPEError
from ..common import device_route, underflow_threshold

try:  # triton is the optional extra `[triton]`
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None
    HAS_TRITON = False

DEFAULT_CHUNK = 64


def interpreting() -> bool:
    """True when `TRITON_INTERPRET=1` is set now (Triton then runs kernels on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: whether this module's kernels were decorated under the interpreter: `triton.jit` reads
#: TRITON_INTERPRET when it decorates, not when it runs
INTERPRETED = HAS_TRITON and interpreting()


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why these kernels cannot run on `device` (None: they can)."""
    if not HAS_TRITON:
        return "needs triton (pip install 'fastrpe[triton]')"
    if device.type == "cuda" and not INTERPRETED:
        return None
    if device.type == "cpu" and INTERPRETED:
        return None
    return "needs CUDA and triton (or TRITON_INTERPRET=1, set before the kernels are imported, for CPU tests)"


def launch_device(t: Tensor):
    """Triton launches on the current CUDA device and its current stream, not on its arguments'
    device: a context making `t`'s device current where it is not (tensors on cuda:1 while
    cuda:0 is current would be read from the wrong GPU). Nothing to do on the CPU, where it is
    current already, or under `torch.compile` (Inductor guards the device of the kernels it
    launches)."""
    if t.is_cuda and not torch.compiler.is_compiling() and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def on_device_of(i: int):
    """Decorator: run the function under `launch_device(args[i])` (the autograd functions'
    forward and backward, the decoding steps: every function that launches kernels)."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with launch_device(args[i]):
                return fn(*args, **kwargs)
        return run
    return wrap


def triton_route(setting: str, name: str, device: torch.device) -> bool:
    """Whether a switch set to `setting` (`ops.common.device_route`; `name` is the switch, for
    the error) sends a call on `device` to its kernel: "cuda" on CUDA devices, "always"
    wherever the kernels run (the interpreter included: the tests), "never" not at all."""
    return device_route(setting, name, device) and triton_unavailable_reason(device) is None


#: Why no kernel here feeds `tl.dot` a `tl.trans` of another product's result: Triton 3.4.0 to
#: 3.7.0 on Hopper (sm_90) miscompiles that operand once it is rounded to 16 bits (the shared-
#: memory store of the transposed accumulator layout, `#linear` in the TTGIR, is emitted as
#: `stmatrix`): wrong values or an illegal memory access. flash-linear-attention's issue #640
#: traced its wrong `dk` on H100/H20 to the same pattern, fixed in Triton 3.7.1; torch 2.8 to
#: 2.11 pin 3.4.0 to 3.6.0 (the H100 sessions ran torch 2.11 with 3.6.0). Our three key-tile
#: gradient kernels had it (`dk += trans(dA) @ q`) wherever an operand is rounded to 16 bits —
#: bf16 features and "bf16x3" products, never "tf32x3" — which is where the H100 stopped with
#: an illegal memory access (bf16x3: triton_soe, triton_band, triton_tiled) and where the first
#: session's float64 comparisons failed (bf16 features: triton_chunked, triton_soe). Where an
#: operand is rounded to 16 bits they now form each key-major tile as such (`dot(k, trans(q))`,
#: a transposed load, not a transposed product); triton_chunked's and triton_soe's keep the
#: transposed products for 32-bit operands (tf32x3), which spill half as much there (the
#: interpreter runs both forms: float32 features, and bf16 features or emulated bf16x3).
#: tests/test_triton_compile.py checks every kernel's sm_90 TTGIR for the pattern.
HOPPER_TRANS_NOTE = "fla-org/flash-linear-attention#640; Triton >= 3.7.1 fixes it"


if HAS_TRITON:

    @triton.jit
    def _split_bf16(x):
        """`(hi, lo)`, both bf16, with `hi + lo` = float32 x to 16 significant bits (relative
        error at most 2^-17): hi is x rounded, lo the rest rounded."""
        hi = x.to(tl.bfloat16)
        return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)

    @triton.jit
    def _bf16_product(x, y, EMULATE: tl.constexpr):
        """float32 `x @ y` of bf16 tiles: one tensor-core pass, or (EMULATE, the interpreter,
        whose bf16 `tl.dot` is wrong) the same exact products in float32."""
        if EMULATE:
            return tl.dot(x.to(tl.float32), y.to(tl.float32), out_dtype=tl.float32)
        else:
            return tl.dot(x, y, out_dtype=tl.float32)

    @triton.jit
    def _dot_bf16x3(a, b, EMULATE: tl.constexpr):
        """float32 `a @ b` from bf16 products of the operands' halves (`_split_bf16`):
        `a_lo·b_hi + a_hi·b_lo + a_hi·b_hi`, small terms first (the `a_lo·b_lo` term, 2^-16 of
        the product, left out), or two products where one operand is bf16 already (exact: its
        lo is 0). Each product is a bf16 pass, twice as fast as a tf32 one, so this costs 3 (or
        2) passes where tf32x3 costs 6 (Triton does not know that a widened bf16 operand has no
        low part). EMULATE: `_bf16_product`'s float32 stand-in (the interpreter's cast to bf16
        truncates where the GPU's rounds to nearest: its halves hold 16 bits, not 17). Two bf16
        operands: one pass, exact."""
        if a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16:
            return _bf16_product(a, b, EMULATE)
        elif a.dtype == tl.bfloat16:
            b_hi, b_lo = _split_bf16(b.to(tl.float32))
            return _bf16_product(a, b_lo, EMULATE) + _bf16_product(a, b_hi, EMULATE)
        elif b.dtype == tl.bfloat16:
            a_hi, a_lo = _split_bf16(a.to(tl.float32))
            return _bf16_product(a_lo, b, EMULATE) + _bf16_product(a_hi, b, EMULATE)
        else:
            a_hi, a_lo = _split_bf16(a.to(tl.float32))
            b_hi, b_lo = _split_bf16(b.to(tl.float32))
            small = _bf16_product(a_lo, b_hi, EMULATE) + _bf16_product(a_hi, b_lo, EMULATE)
            return small + _bf16_product(a_hi, b_hi, EMULATE)

    @triton.jit
    def _split_tf32(x):
        """`(hi, lo)`, both float32, `hi + lo = x` exactly (x finite): hi is x rounded to tf32's
        10 explicit bits (to nearest, ties away from zero, as Triton's own tf32x3 split,
        `cvt.rna.tf32.f32`), lo the rest, at most 2^-11 of |x|."""
        hi = ((x.to(tl.int32, bitcast=True) + 0x1000) & -0x2000).to(tl.float32, bitcast=True)
        return hi, x - hi

    @triton.jit
    def _dot_tf32x2(a, b, ACC: tl.constexpr):
        """float32 `a @ b` where one operand is bf16 or fp16 (exact in tf32): two tf32
        tensor-core products, the other operand's halves (`_split_tf32`) against it, the small
        one first. "tf32x3" takes three (Triton splits both operands, and the 16-bit one's small
        half is 0): the same sums to tf32x3's accuracy, a product of the small half against a
        zero left out. As Triton's, a NaN of the small product (an infinite operand's halves:
        `inf - inf`) is dropped, so that the big one gives the infinity."""
        if a.dtype == tl.float32:
            hi, lo = _split_tf32(a)
            bb = b.to(tl.float32)
            small = tl.dot(lo, bb, input_precision="tf32", out_dtype=ACC)
            x, y = hi, bb
        else:
            hi, lo = _split_tf32(b)
            aa = a.to(tl.float32)
            small = tl.dot(aa, lo, input_precision="tf32", out_dtype=ACC)
            x, y = aa, hi
        small = tl.where(small != small, 0.0, small)
        return tl.dot(x, y, acc=small, input_precision="tf32", out_dtype=ACC)

    @triton.jit
    def _dot(a, b, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr):
        """`a @ b` with operands rounded to DT and products summed in ACC. MODE (`dot_mode`):
        1 the interpreter; 2 float32 operands by three tf32 tensor-core products, two against a
        bf16 or fp16 operand (`_dot_tf32x2`); 3 float32 operands by bf16 products of their
        halves (`_dot_bf16x3`; 4 the same under the interpreter, emulated); 0 the rest (bf16/fp16
        tensor cores, float32/float64 exactly). Two operands that are both bf16 (or both fp16)
        already, such as a bf16 output gradient against bf16 values, take one tensor-core pass
        whatever DT: their products are exact in float32, so the three tf32 passes (or CUDA-core
        float32) would give the same sums at several times the cost."""
        if (MODE == 3 or MODE == 4) and DT == tl.float32 and ACC == tl.float32 and a.dtype != tl.float16 \
                and b.dtype != tl.float16:
            return _dot_bf16x3(a, b, MODE == 4)
        elif MODE == 1 or MODE == 4:
            return tl.dot(a.to(DT).to(ACC), b.to(DT).to(ACC), out_dtype=ACC)
        elif ACC == tl.float32 and a.dtype == b.dtype and (a.dtype == tl.bfloat16 or a.dtype == tl.float16):
            return tl.dot(a, b, out_dtype=ACC)
        elif DT == tl.float32 and (MODE == 2 or MODE == 3) and ACC == tl.float32 and (
                (a.dtype == tl.float32 and (b.dtype == tl.bfloat16 or b.dtype == tl.float16))
                or (b.dtype == tl.float32 and (a.dtype == tl.bfloat16 or a.dtype == tl.float16))):
            return _dot_tf32x2(a, b, ACC)
        elif DT == tl.float32 and (MODE == 2 or MODE == 3):  # (an fp16 operand: bf16 halves cannot multiply it)
            return tl.dot(a.to(DT), b.to(DT), input_precision="tf32x3", out_dtype=ACC)
        elif DT == tl.float32 or DT == tl.float64:
            return tl.dot(a.to(DT), b.to(DT), input_precision="ieee", out_dtype=ACC)
        else:
            return tl.dot(a.to(DT), b.to(DT), out_dtype=ACC)

    @triton.jit
    def _load_rows(ptr, rows, ok, cols, ncols, width):
        """`[len(rows), len(cols)]` tile of a row-major `[*, width]` block (zeros outside)."""
        return tl.load(ptr + rows[:, None] * width + cols[None, :], mask=ok[:, None] & (cols[None, :] < ncols),
                       other=0.0)

    @triton.jit
    def _row_inv(inv_base, rows, ok, ACC: tl.constexpr, SCALED: tl.constexpr):
        """`[len(rows)]` factor of each row of do in the numerator's gradient: SCALED (do is
        the gradient of the quotient `num/den`) its `inv = 1/den`, else 1. The kernels apply
        it to the products of do (all linear in it), not to the do tile: a scaled float32 copy
        of do doubled the float32-feature gradient kernel's register spills (sm_90, ptxas)."""
        if SCALED:
            r = tl.load(inv_base + rows, mask=ok, other=0.0).to(ACC)
        else:
            r = tl.where(ok, 1.0, 0.0).to(ACC)
        return r

    @triton.jit
    def _quotient_dd_kernel(do_ptr, o_ptr, den_ptr, inv_ptr, dd_ptr, R, Dv,
                            BR: tl.constexpr, BC: tl.constexpr, ACC: tl.constexpr, THR: tl.constexpr,
                            DD: tl.constexpr):
        """Grid (cdiv(R, BR),): `inv = 1/den`, 0 where `|den| < THR` (`safe_inverse` in one
        launch, not seven), for R rows; with DD also `dd = -inv·Σ_c do·o` for the rows of the
        `[R, Dv]` quotient `o` and its gradient `do` (the denominator's gradient,
        `quotient_backward`)."""
        r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        rm = r < R
        den = tl.load(den_ptr + r, mask=rm, other=1.0).to(ACC)
        empty = tl.abs(den) < THR
        inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, den))
        tl.store(inv_ptr + r, inv, mask=rm)
        if DD:
            c = tl.arange(0, BC)
            s = tl.zeros([BR], dtype=ACC)
            for c0 in range(0, Dv, BC):
                m = rm[:, None] & ((c0 + c)[None, :] < Dv)
                off = r[:, None] * Dv + (c0 + c)[None, :]
                s += tl.sum(tl.load(do_ptr + off, mask=m, other=0.0).to(ACC)
                            * tl.load(o_ptr + off, mask=m, other=0.0).to(ACC), 1)
            tl.store(dd_ptr + r, -inv * s, mask=rm)

    @triton.jit
    def _bf16_bits(x):
        """float32 `x` rounded to bf16 (to nearest, ties to even), as int16 bits: written out,
        because a store that converts truncates under the interpreter and rounds on the GPU."""
        b = x.to(tl.float32).to(tl.uint32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)

    @triton.jit
    def _bf16_value(bits):
        """The float32 value of bf16 numbers held as int16 bits (`_bf16_bits`'s inverse)."""
        return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _divide_rows(o, den, THR: tl.constexpr):
        """`o [R, C] / den [R]` row by row, 0 where `|den| < THR` (`underflow_threshold`): the
        quotient as `safe_divide` forms it."""
        empty = tl.abs(den) < THR
        return o * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, den))[:, None]

    @triton.jit
    def _store_tile(ptr, x, mask, AS_BF16: tl.constexpr):
        """`x` stored at `ptr` (a tile of pointers): AS_BF16, into the int16 view of a bf16
        tensor, rounded to nearest (`_bf16_bits`); else converted to the pointer's dtype.
        (A branch may not change a variable's type: one store per branch.)"""
        if AS_BF16:
            tl.store(ptr, _bf16_bits(x), mask=mask)
        else:
            tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _block_start(h_base, z_base, c_ptr, cz_ptr, bh, blk, NB, f, c, BF: tl.constexpr, BV: tl.constexpr,
                     BDV: tl.constexpr, ACC: tl.constexpr, PHASE: tl.constexpr):
        """The state a state pass starts from: PHASE 0, the one at h_base/z_base; 1, zero (a
        block's own total); 2, block blk's carry (`_block_carries`)."""
        if PHASE == 1:
            S = tl.zeros([BF, BV], dtype=ACC)
            z = tl.zeros([BF], dtype=ACC)
        elif PHASE == 2:
            S = tl.load(c_ptr + (bh * NB + blk) * BF * BDV + f[:, None] * BDV + c[None, :]).to(ACC)
            z = tl.load(cz_ptr + (bh * NB + blk) * BF + f).to(ACC)
        else:
            S = tl.load(h_base + f[:, None] * BDV + c[None, :]).to(ACC)
            z = tl.load(z_base + f).to(ACC)
        return S, z

    @triton.jit
    def _block_total(c_ptr, cz_ptr, cb, S, z, f, c, iv, BF: tl.constexpr, BDV: tl.constexpr):
        """PHASE 1's output: block cb's final state from zero (z by the first value block)."""
        tl.store(c_ptr + cb * BF * BDV + f[:, None] * BDV + c[None, :], S)
        tl.store(cz_ptr + cb * BF + f, z, mask=(f + iv * BF) < BF)

    @triton.jit
    def _fwd_state_kernel(k_ptr, v_ptr, lg_ptr, h_ptr, z_ptr, c_ptr, cz_ptr, H, Lk, F, Dv, N, G, NB,
                          BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
                          DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr, PHASE: tl.constexpr = 0):
        """Grid (B·H, BDV/BV, NB): program blk runs chunks blk·G .. blk·G+G-1 (PHASE 0: NB = 1,
        G = N, from h[:, 0], the initial state). Writes h[:, n+1] after each chunk n; PHASE 1
        (from zero) writes only the block's final state, into c_ptr/cz_ptr `[B·H, NB, ...]`;
        PHASE 2 starts from c_ptr/cz_ptr (`STATE_SCAN = "blocked"`)."""
        bh = tl.program_id(0).to(tl.int64)
        iv = tl.program_id(1)
        blk = tl.program_id(2)
        lg = tl.load(lg_ptr + bh % H).to(ACC)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = iv * BV + tl.arange(0, BV)
        k_base = k_ptr + bh * Lk * F
        v_base = v_ptr + bh * Lk * Dv
        h_base = h_ptr + bh * (N + 1) * BF * BDV
        z_base = z_ptr + bh * (N + 1) * BF
        S, z = _block_start(h_base, z_base, c_ptr, cz_ptr, bh, blk, NB, f, c, BF, BV, BDV, ACC, PHASE)  # in ACC
        for n in range(blk * G, tl.minimum(blk * G + G, N)):
            pos = n * BT + t
            km = pos < Lk
            kk = tl.load(k_base + pos[:, None] * F + f[None, :], mask=km[:, None] & (f[None, :] < F), other=0.0).to(ACC)
            vv = tl.load(v_base + pos[:, None] * Dv + c[None, :], mask=km[:, None] & (c[None, :] < Dv), other=0.0)
            e_prev = tl.minimum(n * BT, Lk)
            e_n = tl.minimum(n * BT + BT, Lk)
            kdec = tl.where(pos < e_n, tl.exp(lg * (e_n - 1 - pos).to(ACC)), 0.0)  # (BT,)
            kt = kk * kdec[:, None]
            g = tl.exp(lg * (e_n - e_prev).to(ACC))
            S = S * g + _dot(tl.trans(kt), vv, DT, ACC, MODE)
            z = z * g + tl.sum(kt, 0)
            if PHASE != 1:
                tl.store(h_base + (n + 1) * BF * BDV + f[:, None] * BDV + c[None, :], S.to(h_ptr.dtype.element_ty))
                tl.store(z_base + (n + 1) * BF + f, z, mask=(f + iv * BF) < BF)  # only the first value block
        if PHASE == 1:
            _block_total(c_ptr, cz_ptr, bh * NB + blk, S, z, f, c, iv, BF, BDV)

    @triton.jit(do_not_specialize=["LB"])
    def _fwd_out_kernel(q_ptr, k_ptr, v_ptr, lg_ptr, h_ptr, z_ptr, num_ptr, den_ptr, H, Lq, Lk, F, Dv, N, q_offset, LB,
                        BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
                        STRICT: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                        DIVIDE: tl.constexpr = False, THR: tl.constexpr = 0.0, OUT_BF16: tl.constexpr = False):
        """Grid (N, B·H, BDV/BV): the outputs of chunk n from the state entering it. DIVIDE:
        num_ptr gets the quotient `num/den` (0 where `|den| < THR`, `underflow_threshold`, as
        `safe_divide`); OUT_BF16: num_ptr is the int16 view of a bf16 output."""
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        iv = tl.program_id(2)
        lg = tl.load(lg_ptr + bh % H).to(ACC)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = iv * BV + tl.arange(0, BV)
        pos = n * BT + t
        qi = pos - q_offset
        qm = (qi >= 0) & (qi < Lq)
        km = pos < Lk
        fm = f[None, :] < F
        q = tl.load(q_ptr + bh * Lq * F + qi[:, None] * F + f[None, :], mask=qm[:, None] & fm, other=0.0).to(ACC)
        k = tl.load(k_ptr + bh * Lk * F + pos[:, None] * F + f[None, :], mask=km[:, None] & fm, other=0.0).to(ACC)
        v = tl.load(v_ptr + bh * Lk * Dv + pos[:, None] * Dv + c[None, :], mask=km[:, None] & (c[None, :] < Dv),
                    other=0.0)
        S = tl.load(h_ptr + (bh * (N + 1) + n) * BF * BDV + f[:, None] * BDV + c[None, :])  # (BF, BV)
        z = tl.load(z_ptr + (bh * (N + 1) + n) * BF + f)  # (BF,)
        e_prev = tl.minimum(n * BT, Lk)
        qt = q * tl.exp(lg * (pos - e_prev + 1).to(ACC))[:, None]
        d = t[:, None] - t[None, :]
        if STRICT:
            keep = d > 0
        else:
            keep = d >= 0
        D = tl.where(keep, tl.exp(lg * tl.maximum(d, 0).to(ACC)), 0.0)  # (BT, BT)
        A = _dot(q, tl.trans(k), DT, ACC, MODE) * D
        o = _dot(qt, S, DT, ACC, MODE) + _dot(A, v, DT, ACC, MODE)
        den = tl.sum(qt * z[None, :], 1) + tl.sum(A, 1)  # (every value block forms it: it needs A only)
        if DIVIDE:
            o = _divide_rows(o, den, THR)
        _store_tile(num_ptr + bh * Lq * Dv + qi[:, None] * Dv + c[None, :], o, qm[:, None] & (c[None, :] < Dv), OUT_BF16)
        # the first value block writes den
        tl.store(den_ptr + bh * Lq + qi, den.to(den_ptr.dtype.element_ty), mask=qm & ((t + iv * BT) < BT))

    @triton.jit
    def _carry_kernel(tot_ptr, lg_ptr, start_ptr, c_ptr, n_lg, s_row, W, N, G, NB, Lk, BT: tl.constexpr,
                      REVERSE: tl.constexpr, FROM_ZERO: tl.constexpr, BW: tl.constexpr, ACC: tl.constexpr):
        """Grid (rows, cdiv(W, BW)): the blocked scan's carries (`_block_carries`) of W numbers
        per state, walked over the NB blocks: S_0 = start (zero if FROM_ZERO), then
        S_{b+1} = γ^(E_{b+1} - E_b)·S_b + tot_b with E_b = min(min(b·G, N)·BT, Lk); REVERSE
        walks b from NB-1 down. Row r decays by lg_ptr[r % n_lg]."""
        r = tl.program_id(0).to(tl.int64)
        w = tl.program_id(1) * BW + tl.arange(0, BW)
        m = w < W
        lg = tl.load(lg_ptr + r % n_lg).to(ACC)
        if FROM_ZERO:
            S = tl.zeros([BW], dtype=ACC)
        else:
            S = tl.load(start_ptr + r * s_row + w, mask=m, other=0.0).to(ACC)
        for i in range(0, NB):
            if REVERSE:
                b = NB - 1 - i
            else:
                b = i
            at = (r * NB + b) * W + w
            tl.store(c_ptr + at, S.to(c_ptr.dtype.element_ty), mask=m)
            e0 = tl.minimum(tl.minimum(b * G, N) * BT, Lk)
            e1 = tl.minimum(tl.minimum(b * G + G, N) * BT, Lk)
            S = S * tl.exp(lg * (e1 - e0).to(ACC)) + tl.load(tot_ptr + at, mask=m, other=0.0).to(ACC)

    @triton.jit
    def _bwd_state_kernel(q_ptr, do_ptr, inv_ptr, dd_ptr, lg_ptr, dh_ptr, dz_ptr, c_ptr, cz_ptr, H, Lq, Lk, F, Dv, N,
                          G, NB, q_offset,
                          BT: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, BDV: tl.constexpr,
                          DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr, SCALED: tl.constexpr,
                          PHASE: tl.constexpr = 0):
        """Grid (B·H, BDV/BV, NB): program blk runs chunks blk·G+G-1 down to blk·G (PHASE 0: NB =
        1, G = N, from dh[:, N], the final state's gradient). Writes dh[:, n] (the gradient of
        the state entering chunk n; dh[:, 0] is the initial state's); PHASE 1 and 2 as in
        `_fwd_state_kernel`. SCALED: do is the quotient's gradient, its rows scaled by inv
        (`_row_inv`)."""
        bh = tl.program_id(0).to(tl.int64)
        iv = tl.program_id(1)
        blk = tl.program_id(2)
        lg = tl.load(lg_ptr + bh % H).to(ACC)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = iv * BV + tl.arange(0, BV)
        dh_base = dh_ptr + bh * (N + 1) * BF * BDV
        dz_base = dz_ptr + bh * (N + 1) * BF
        dS, dz = _block_start(dh_base + N * BF * BDV, dz_base + N * BF, c_ptr, cz_ptr, bh, blk, NB, f, c, BF, BV,
                              BDV, ACC, PHASE)  # carried in ACC
        n_hi = tl.minimum(blk * G + G, N)
        for i in range(n_hi - blk * G):
            n = n_hi - 1 - i
            pos = n * BT + t
            qi = pos - q_offset
            qm = (qi >= 0) & (qi < Lq)
            q = tl.load(q_ptr + bh * Lq * F + qi[:, None] * F + f[None, :], mask=qm[:, None] & (f[None, :] < F),
                        other=0.0).to(ACC)
            do = tl.load(do_ptr + bh * Lq * Dv + qi[:, None] * Dv + c[None, :], mask=qm[:, None] & (c[None, :] < Dv),
                         other=0.0)
            dd = tl.load(dd_ptr + bh * Lq + qi, mask=qm, other=0.0).to(ACC)
            e_prev = tl.minimum(n * BT, Lk)
            e_n = tl.minimum(n * BT + BT, Lk)
            qt = q * tl.exp(lg * (pos - e_prev + 1).to(ACC))[:, None]
            g = tl.exp(lg * (e_n - e_prev).to(ACC))
            qs = qt * _row_inv(inv_ptr + bh * Lq, qi, qm, ACC, SCALED)[:, None]
            dS = dS * g + _dot(tl.trans(qs), do, DT, ACC, MODE)
            dz = dz * g + tl.sum(qt * dd[:, None], 0)
            if PHASE != 1:
                tl.store(dh_base + n * BF * BDV + f[:, None] * BDV + c[None, :], dS.to(dh_ptr.dtype.element_ty))
                tl.store(dz_base + n * BF + f, dz, mask=(f + iv * BF) < BF)  # only the first value block
        if PHASE == 1:
            _block_total(c_ptr, cz_ptr, bh * NB + blk, dS, dz, f, c, iv, BF, BDV)

    @triton.jit
    def _chunk_tiles(k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg, bh, n, H, Lq, Lk, F, Dv, q_offset,
                     BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr, STRICT: tl.constexpr,
                     DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr, SCALED: tl.constexpr,
                     KEY_MAJOR: tl.constexpr = False):
        """What both gradient kernels read of chunk n: φk `[BT, BF]`, v and do `[BT, BDV]`, dd
        and the rows' factor inv `[BT]`, the decays `D [BT, BT]` within the chunk (query
        t, key s), and `dA = (dy·[v, 1]) ⊙ D` (dy = inv·do, dd). KEY_MAJOR: D and dA
        transposed (key s, query t), each formed as such (`HOPPER_TRANS_NOTE`)."""
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = tl.arange(0, BDV)
        pos = n * BT + t
        qi = pos - q_offset
        qm = (qi >= 0) & (qi < Lq)
        km = pos < Lk
        cm = c[None, :] < Dv
        k = tl.load(k_ptr + bh * Lk * F + pos[:, None] * F + f[None, :], mask=km[:, None] & (f[None, :] < F),
                    other=0.0).to(ACC)
        v = tl.load(v_ptr + bh * Lk * Dv + pos[:, None] * Dv + c[None, :], mask=km[:, None] & cm, other=0.0)
        do = tl.load(do_ptr + bh * Lq * Dv + qi[:, None] * Dv + c[None, :], mask=qm[:, None] & cm, other=0.0)
        dd = tl.load(dd_ptr + bh * Lq + qi, mask=qm, other=0.0).to(ACC)
        inv = _row_inv(inv_ptr + bh * Lq, qi, qm, ACC, SCALED)
        if KEY_MAJOR:
            d = t[None, :] - t[:, None]
        else:
            d = t[:, None] - t[None, :]  # query minus key
        if STRICT:
            keep = d > 0
        else:
            keep = d >= 0
        D = tl.where(keep, tl.exp(lg * tl.maximum(d, 0).to(ACC)), 0.0)  # (BT, BT)
        # dy·[v, 1] within the chunk
        if KEY_MAJOR:
            dA = (inv[None, :] * _dot(v, tl.trans(do), DT, ACC, MODE) + dd[None, :]) * D
        else:
            dA = (inv[:, None] * _dot(do, tl.trans(v), DT, ACC, MODE) + dd[:, None]) * D
        return k, v, do, dd, inv, D, dA

    @triton.jit(do_not_specialize=["LB"])
    def _bwd_dkv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg_ptr, dh_ptr, dz_ptr, dk_ptr, dv_ptr,
                        H, Lq, Lk, F, Dv, N, q_offset, LB,
                        BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr,
                        STRICT: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                        SCALED: tl.constexpr, DV_BF16: tl.constexpr = False):
        """Grid (N, B·H): dφk and dv of chunk n, from its own queries and from the gradient of
        the state leaving it (every value column in one program: dφk sums over them).
        DV_BF16: dv_ptr is the int16 view of a bf16 dv. SCALED as `_bwd_state_kernel`'s."""
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        dk, pos, km = _dkv_tiles(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg_ptr, dh_ptr, dz_ptr, dv_ptr,
                                 bh, n, H, Lq, Lk, F, Dv, N, q_offset, BT, BF, BDV, STRICT, DT, ACC, MODE, SCALED,
                                 DV_BF16)
        f = tl.arange(0, BF)
        tl.store(dk_ptr + bh * Lk * F + pos[:, None] * F + f[None, :], dk, mask=km[:, None] & (f[None, :] < F))

    @triton.jit
    def _dkv_tiles(q_ptr, k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg_ptr, dh_ptr, dz_ptr, dv_ptr, bh, n,
                   H, Lq, Lk, F, Dv, N, q_offset,
                   BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr,
                   STRICT: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                   SCALED: tl.constexpr, DV_BF16: tl.constexpr):
        """`_bwd_dkv_kernel`'s chunk n of head bh: stores dv, returns `(dφk [BT, BF] in ACC,
        positions [BT], their mask)` for the caller to store (or to take through the key map's
        backward, `triton_chunked_prf`)."""
        lg = tl.load(lg_ptr + bh % H).to(ACC)
        # 16-bit operands: dAᵀ and Aᵀ formed key-major (`HOPPER_TRANS_NOTE`)
        KEY_MAJOR: tl.constexpr = DT == tl.bfloat16 or DT == tl.float16 or MODE >= 3
        k, v, do, dd, inv, D, dA = _chunk_tiles(k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg, bh, n, H, Lq, Lk, F, Dv,
                                                q_offset, BT, BF, BDV, STRICT, DT, ACC, MODE, SCALED, KEY_MAJOR)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = tl.arange(0, BDV)
        pos = n * BT + t
        qi = pos - q_offset
        qm = (qi >= 0) & (qi < Lq)
        km = pos < Lk
        fm = f[None, :] < F
        cm = c[None, :] < Dv
        q = tl.load(q_ptr + bh * Lq * F + qi[:, None] * F + f[None, :], mask=qm[:, None] & fm, other=0.0).to(ACC)
        off = (bh * (N + 1) + n + 1) * BF  # the state leaving chunk n
        dS = tl.load(dh_ptr + off * BDV + f[:, None] * BDV + c[None, :])  # (BF, BDV)
        dz = tl.load(dz_ptr + off + f)
        e_n = tl.minimum(n * BT + BT, Lk)
        kdec = tl.where(pos < e_n, tl.exp(lg * (e_n - 1 - pos).to(ACC)), 0.0)
        if KEY_MAJOR:
            dk = _dot(dA, q, DT, ACC, MODE)
            dv = _dot(_dot(k, tl.trans(q), DT, ACC, MODE) * D * inv[None, :], do, DT, ACC, MODE)
        else:  # transposed products, fewer spills (tf32x3, 4 warps: 260 B against 792 key-major)
            dk = _dot(tl.trans(dA), q, DT, ACC, MODE)
            dv = _dot(tl.trans(_dot(q, tl.trans(k), DT, ACC, MODE) * D * inv[:, None]), do, DT, ACC, MODE)
        dk += kdec[:, None] * (_dot(v, tl.trans(dS), DT, ACC, MODE) + dz[None, :])
        dv += _dot(k * kdec[:, None], dS, DT, ACC, MODE)
        _store_tile(dv_ptr + bh * Lk * Dv + pos[:, None] * Dv + c[None, :], dv, km[:, None] & cm, DV_BF16)
        return dk, pos, km

    @triton.jit(do_not_specialize=["LB"])
    def _bwd_dq_kernel(k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg_ptr, h_ptr, z_ptr, dq_ptr,
                       H, Lq, Lk, F, Dv, N, q_offset, LB,
                       BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr,
                       STRICT: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                       SCALED: tl.constexpr):
        """Grid (N, B·H): dφq of chunk n, from its own keys and from the state entering it.
        SCALED as `_bwd_state_kernel`'s."""
        n = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        dq, qi, qm = _dq_tile(k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg_ptr, h_ptr, z_ptr, bh, n, H, Lq, Lk, F, Dv,
                              N, q_offset, BT, BF, BDV, STRICT, DT, ACC, MODE, SCALED)
        f = tl.arange(0, BF)
        tl.store(dq_ptr + bh * Lq * F + qi[:, None] * F + f[None, :], dq, mask=qm[:, None] & (f[None, :] < F))

    @triton.jit
    def _dq_tile(k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg_ptr, h_ptr, z_ptr, bh, n, H, Lq, Lk, F, Dv, N, q_offset,
                 BT: tl.constexpr, BF: tl.constexpr, BDV: tl.constexpr,
                 STRICT: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, MODE: tl.constexpr,
                 SCALED: tl.constexpr):
        """`_bwd_dq_kernel`'s chunk n of head bh: `(dφq [BT, BF] in ACC, query rows [BT], their
        mask)` for the caller to store (or to take through the query map's backward,
        `triton_chunked_prf`)."""
        lg = tl.load(lg_ptr + bh % H).to(ACC)
        k, v, do, dd, inv, D, dA = _chunk_tiles(k_ptr, v_ptr, do_ptr, inv_ptr, dd_ptr, lg, bh, n, H, Lq, Lk, F, Dv,
                                                q_offset, BT, BF, BDV, STRICT, DT, ACC, MODE, SCALED)
        t = tl.arange(0, BT)
        f = tl.arange(0, BF)
        c = tl.arange(0, BDV)
        pos = n * BT + t
        qi = pos - q_offset
        qm = (qi >= 0) & (qi < Lq)
        off = (bh * (N + 1) + n) * BF  # the state entering chunk n
        S = tl.load(h_ptr + off * BDV + f[:, None] * BDV + c[None, :])  # (BF, BDV)
        z = tl.load(z_ptr + off + f)
        qdec = tl.exp(lg * (pos - tl.minimum(n * BT, Lk) + 1).to(ACC))
        dq = _dot(dA, k, DT, ACC, MODE) + qdec[:, None] * (inv[:, None] * _dot(do, tl.trans(S), DT, ACC, MODE)
                                                              + dd[:, None] * z[None, :])
        return dq, qi, qm


#: How the chunk-state passes (forward and backward; triton_soe's and triton_band's per term
#: too, through `_state_pass`) run over the chunks: "sequential", one program per
#: (batch·head, value block[, term]) walking all N chunks (triton_chunked at 64k tokens: 1,024
#: steps in 32 programs, a quarter of an H100's SMs); "blocked", in blocks of about √N chunks
#: walked side by side twice (their totals from zero, then the states from each block's
#: carry), the carries from the totals by one small kernel (`_block_carries`): √N-deep steps
#: in √N times the programs, for twice the work. Both give the recurrence's states; their
#: float32 sums differ in order. "auto" (the default) runs "blocked" on a GPU where the
#: sequential pass would leave most SMs idle over many chunks (`auto_blocked`), else
#: "sequential". On the H100 (2026-11-27, docs/RESULTS.md) at 64k, blocked took the two state
#: kernels of triton_chunked's call from 2.7 to 0.9 ms of device time and triton_band's T5 call
#: from 9.7 to 7.2 ms, while triton_soe's KERPLE-log kernels, already 128 programs, rose from
#: 5.0 to 7.4 ms; at 4k (64 chunks) blocked was slower everywhere.
STATE_SCAN = "auto"
STATE_SCANS = ("auto", "sequential", "blocked")
#: below this many chunks "blocked" runs "sequential" (nothing to split)
BLOCKED_MIN_CHUNKS = 16
#: "auto" runs "blocked" from this many chunks on (16k tokens in 64-token chunks) ...
AUTO_BLOCKED_MIN_CHUNKS = 256
#: ... where the sequential pass's programs fill under this share of the GPU's SMs
AUTO_BLOCKED_SM_SHARE = 0.5


@contextlib.contextmanager
def use_state_scan(mode: str):
    """`STATE_SCAN = mode` inside the block (a call's backward keeps its forward's)."""
    global STATE_SCAN
    scan_blocks(1, mode)  # checks the name
    before, STATE_SCAN = STATE_SCAN, mode
    try:
        yield
    finally:
        STATE_SCAN = before


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def auto_blocked(N: int, programs: int | None, device) -> bool:
    """Whether "auto" runs a pass over `N` chunks blocked: on a CUDA device, from
    `AUTO_BLOCKED_MIN_CHUNKS` chunks, when the sequential pass's `programs` fill under
    `AUTO_BLOCKED_SM_SHARE` of its SMs. Elsewhere (the CPU, the interpreter) "sequential"."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or programs is None or N < AUTO_BLOCKED_MIN_CHUNKS:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return programs < AUTO_BLOCKED_SM_SHARE * _sm_count(index)


def scan_blocks(N: int, mode: str | None = None, programs: int | None = None, device=None) -> tuple[int, int]:
    """`(G, NB)`: chunks per block and blocks for N chunks under `mode` (default
    `STATE_SCAN`; `(N, 1)`: sequential). "auto" decides from the sequential pass's grid size
    `programs` and the `device` (`auto_blocked`)."""
    mode = STATE_SCAN if mode is None else mode
    if mode not in STATE_SCANS:
        raise FastRPEError(f"triton_chunked.STATE_SCAN: expected one of {STATE_SCANS}, got {mode!r}")
    if mode == "auto":
        mode = "blocked" if auto_blocked(N, programs, device) else "sequential"
    if mode == "sequential" or N < BLOCKED_MIN_CHUNKS:
        return N, 1
    G = max(1, round(N ** 0.5))
    return G, -(-N // G)


def block_carries_reference(tot: Tensor, totz: Tensor, log_g: Tensor, start: Tensor, startz: Tensor, N: int,
                            G: int, BT: int, Lk: int, reverse: bool) -> tuple[Tensor, Tensor]:
    """Each block's starting state from the blocks' own totals (`tot [B·H, NB, BF, BDV]`,
    `totz [B·H, NB, BF]`, each from a zero state) and the pass's start (`start`, `startz`: the
    initial state, or, `reverse`, the final state's gradient), in tot's dtype.

    With key ends `E_b = min(min(b·G, N)·T, Lk)`, the state entering block b is
    `Σ_{b'<b} γ^(E_b - E_{b'+1}) tot_{b'} + γ^(E_b) start`; in reverse, the gradient leaving
    block b is `Σ_{b'>b} γ^(E_{b'} - E_{b+1}) tot_{b'} + γ^(E_NB - E_{b+1}) start`. One product
    in float64: a float32 one may run in TF32 (`torch.set_float32_matmul_precision`).

    The naive form, in PyTorch ops, that the tests hold `_block_carries` (the kernel the scan
    runs) to: about 30 launches, which made the blocked scan host-bound on the H100."""
    BHn, NB = tot.shape[:2]
    f64 = torch.float64
    # from shapes alone, made on the device (no copy from the host)
    E = ((torch.arange(NB + 1, device=tot.device) * G).clamp(max=N) * BT).clamp(max=Lk).to(f64)
    lg = log_g.to(f64).repeat(BHn // log_g.numel())[:, None, None]  # [B·H, 1, 1], ≤ 0
    b = torch.arange(NB, device=tot.device)
    if reverse:
        gap, keep = E[None, :NB] - E[1:, None], b[None, :] > b[:, None]  # (b, b'): E_{b'} - E_{b+1}
        to_start = E[NB] - E[1:]
    else:
        gap, keep = E[:NB, None] - E[None, 1:], b[None, :] < b[:, None]  # (b, b'): E_b - E_{b'+1}
        to_start = E[:NB]
    W = torch.where(keep, torch.exp(lg * gap.clamp(min=0)), 0.0)  # [B·H, NB, NB]
    decay = torch.exp(lg[:, :, 0] * to_start)  # [B·H, NB]
    flat = torch.cat([tot.reshape(BHn, NB, -1), totz], -1).to(f64)
    first = torch.cat([start.reshape(BHn, 1, -1), startz.reshape(BHn, 1, -1)], -1).to(f64)
    out = (W @ flat + decay[..., None] * first).to(tot.dtype)
    nz = totz.shape[-1]  # (the kernels read both as contiguous)
    return out[..., :-nz].contiguous().view(tot.shape), out[..., -nz:].contiguous()


def _block_carries(tot: Tensor, totz: Tensor, log_g: Tensor, start: Tensor | None, startz: Tensor | None, N: int,
                   G: int, BT: int, Lk: int, reverse: bool) -> tuple[Tensor, Tensor]:
    """`block_carries_reference`'s carries by its recurrence, one small kernel launch for the
    states and one for the normalizer's (`_carry_kernel`: each row's NB blocks in turn,
    √N steps), in tot's dtype; `start`/`startz` None: from zero. On the H100 (2026-11-27,
    docs/RESULTS.md) the ~30 PyTorch ops of the matrix form took the blocked scan's call from
    48 to 179 launches, and its ALiBi call at 64k from 5.6 ms (sequential) to 6.7 ms, though
    its two state kernels' device time fell from 2.7 to 0.9 ms (benchmarks/gpu_profile.py)."""
    rows, NB = tot.shape[:2]
    lg = log_g.detach().reshape(-1).contiguous()
    carry, carryz = torch.empty_like(tot), torch.empty_like(totz)
    for t, s, c in ((tot, start, carry), (totz, startz, carryz)):
        W = t[0, 0].numel()
        BW = min(_pow2(W), 1024)
        if s is not None and not s[0].is_contiguous():
            raise FastRPEError("_block_carries: each row's start state must be contiguous")
        _carry_kernel[(rows, triton.cdiv(W, BW))](t, lg, t if s is None else s, c, lg.numel(),
                                                  0 if s is None else s.stride(0), W, N, G, NB, Lk, BT=BT,
                                                  REVERSE=reverse, FROM_ZERO=s is None, BW=BW,
                                                  ACC=_TL_DTYPE[t.dtype])
    return carry, carryz


def _state_pass(launch, h: Tensor, z: Tensor, log_g: Tensor, N: int, BT: int, Lk: int, reverse: bool,
                mode: str, programs: int, from_zero: bool = False) -> None:
    """One chunk-state pass over the chunks as `mode` says (`scan_blocks`), for triton_chunked
    (`h [B·H, N+1, BF, BDV]`, one decay per head) and triton_soe (`h [B·H, K, N, BF, BDV]`, one
    decay per term): states on the third axis from the end, `log_g` repeating along the rows
    before it. `launch(blocks, h, z, c, cz, G, NB, phase)` launches the pass's kernel on
    `blocks` blocks of G chunks, states h and z, carry buffers c, cz and PHASE `phase` (0: one
    block). The pass starts from h/z at chunk 0 (`reverse`: at N), or from zero (`from_zero`).
    `programs`: the size of the sequential pass's grid, which "auto" weighs (`auto_blocked`)."""
    G, NB = scan_blocks(N, mode, programs, h.device)
    if NB == 1:
        launch(1, h, z, h, z, N, 1, 0)
        return
    BF, BDV, acc = h.shape[-2], h.shape[-1], z.dtype
    rows = h.numel() // (h.shape[-3] * BF * BDV)  # B·H, or B·H·K
    tot = torch.empty(rows, NB, BF, BDV, dtype=acc, device=h.device)
    totz = torch.empty(rows, NB, BF, dtype=acc, device=h.device)
    launch(NB, h, z, tot, totz, G, NB, 1)
    if from_zero:
        start = startz = None
    else:
        at = N if reverse else 0
        start, startz = h[:, at], z[:, at]
    carry, carryz = _block_carries(tot, totz, log_g, start, startz, N, G, BT, Lk, reverse)
    launch(NB, h, z, carry, carryz, G, NB, 2)


#: (num_warps, num_stages) of the autotuner's configs, in this order. 4 warps only since the
#: sixth H100 session (2026-11-27): of the 103 choices its JSON's rows record (`autotuned`:
#: every tuned kernel, 4k to 1M tokens, benchmarks/results/gpu/h100-2026-11-27d.json), one
#: took 8 warps (`_soe_bwd_dkv_kernel`, once), while each config costs a compilation per
#: kernel variant (the warm-up's workers were 13-35 rows into 62 when its 130 s ran out) and a
#: timed run at each new tuning key (a 1M row's first call took 56 s)
TUNE_CONFIGS = tuple((4, s) for s in (1, 2, 3))


def tune_configs() -> tuple[tuple[int, int], ...]:
    """The (num_warps, num_stages) pairs the autotuned kernels try: `TUNE_CONFIGS`, or only
    the one at index `$FASTRPE_TRITON_CONFIG` when that is set (read when this module is
    imported). `fastrpe.bench.gpu_warm` runs processes per config so that the
    compilations of each kernel happen side by side and land in Triton's on-disk cache
    under the keys a full autotuning run looks up: a one-config autotuner launches its
    config with the same options as a full one times it."""
    pick = os.environ.get("FASTRPE_TRITON_CONFIG", "")
    if pick == "":
        return TUNE_CONFIGS
    if not pick.isdigit() or int(pick) >= len(TUNE_CONFIGS):
        raise FastRPEError(f"FASTRPE_TRITON_CONFIG: expected an index in 0..{len(TUNE_CONFIGS) - 1} "
                           f"of {list(TUNE_CONFIGS)}, got {pick!r}")
    return (TUNE_CONFIGS[int(pick)],)


#: every autotuned kernel (`_tuned`), for `autotune_choices`
TUNED: list = []


def length_bucket(n: int) -> int:
    """The autotuners' length key `LB` of a launch over n chunks (or tiles): n's bit length
    halved, so lengths within a factor of about 4 share a choice (4k and 64k tokens do not: a
    grid 16x larger may want other warps and stages). An argument the kernels do not read,
    never specialized on (`do_not_specialize`): a new bucket times the configs again and
    compiles nothing."""
    return max(1, int(n)).bit_length() // 2


def tune_pairs(min_stages: int = 1) -> tuple[tuple[int, int], ...]:
    """`tune_configs()` with every config of fewer than `min_stages` pipeline stages raised to
    `min_stages` (duplicates dropped, order kept; a pinned config stays one config)."""
    return tuple(dict.fromkeys((w, max(s, min_stages)) for w, s in tune_configs()))


def _tuned(kernel, key, reset=None, restore=None, min_stages=1, num_warps=None):
    """`kernel` autotuned over warps and stages on the GPU (`tune_pairs`); as is under the
    interpreter, which cannot time a config. `reset`: outputs zeroed before each timed run;
    `restore`: outputs the kernel adds to (saved before tuning and put back, so the timed
    runs do not add several times). `min_stages`: for a kernel that is wrong without software
    pipelining (`triton_soe.SOE_DQ_BF16X3_NOTE`). `num_warps`: every config's warps, for a
    kernel that spills at `TUNE_CONFIGS`' (the configs stay as many, in the same order, so
    that `$FASTRPE_TRITON_CONFIG` picks the same stages)."""
    if INTERPRETED:
        return kernel
    configs = [triton.Config({}, num_warps=num_warps or w, num_stages=s) for w, s in tune_pairs(min_stages)]
    tuned = triton.autotune(configs=configs, key=key, reset_to_zero=reset, restore_value=restore)(kernel)
    TUNED.append(tuned)
    return tuned


def autotune_choices() -> dict[str, dict[str, str]]:
    """The configs the autotuners of this process chose so far: kernel name -> {tuning key ->
    config}. The GPU bench records each row's new ones, so that configs that never win can
    be dropped from `TUNE_CONFIGS` (each costs a compilation per kernel variant and a timed
    run at each new key)."""
    out: dict[str, dict[str, str]] = {}
    for a in TUNED:
        fn = getattr(a, "fn", None)
        name = getattr(fn, "__name__", None) or repr(fn)
        for key, cfg in dict(getattr(a, "cache", {}) or {}).items():
            out.setdefault(name, {})[str(key)] = f"num_warps={cfg.num_warps}, num_stages={cfg.num_stages}"
    return out


if HAS_TRITON:
    # MODE in every key: the products' precision (`dot_mode`) changes which config is fastest, and
    # a call in another precision must time its own (tensor dtypes are in the key already)
    _fwd_out_kernel = _tuned(_fwd_out_kernel, ["F", "Dv", "LB", "STRICT", "DIVIDE", "OUT_BF16", "MODE"])
    _bwd_dkv_kernel = _tuned(_bwd_dkv_kernel, ["F", "Dv", "LB", "STRICT", "SCALED", "DV_BF16", "MODE"])
    _bwd_dq_kernel = _tuned(_bwd_dq_kernel, ["F", "Dv", "LB", "STRICT", "SCALED", "MODE"])

_TL_DTYPE = {}
if HAS_TRITON:
    _TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                 torch.float64: tl.float64}


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (x - 1).bit_length()))


#: how float32 operands of `tl.dot` are multiplied on the GPU: "ieee" exactly (CUDA cores),
#: "tf32x3" by three tf32 tensor-core products, two where one operand is bf16 or fp16 already
#: (`_dot_tf32x2`; about float32's accuracy, several times faster), "bf16x3" by three bf16
#: products of the operands' halves, two where one operand is bf16 already (16 significant bits,
#: relative error about 2^-16 per product; as many passes as tf32x3 at twice the rate each
#: against a bf16 operand, half as many for two float32 ones; `_dot_bf16x3`)
PRECISIONS = ("ieee", "tf32x3", "bf16x3")


def dot_mode(precision: str) -> int:
    """The kernels' MODE constant (`_dot`): 0 for "ieee", 2 for "tf32x3", 3 for "bf16x3";
    under the interpreter (no tensor cores: products are exact) 1, but 4 for "bf16x3", whose
    split into bf16 halves it emulates."""
    if precision not in PRECISIONS:
        raise FastRPEError(f"precision: one of {', '.join(PRECISIONS)}, got {precision!r}")
    if INTERPRETED:
        return 4 if precision == "bf16x3" else 1
    return {"ieee": 0, "tf32x3": 2, "bf16x3": 3}[precision]


def value_dtype(v: Tensor, dt: torch.dtype) -> torch.dtype:
    """The dtype the kernels read values in: a bf16/fp16 `v` as it comes (`_dot` widens it to
    the features' dtype in registers, exactly, so no float32 copy of v is stored and saved),
    any other in the features' dtype `dt`."""
    return v.dtype if v.dtype in (torch.bfloat16, torch.float16) else dt


def quotient_flags(divide: torch.dtype | None, acc: torch.dtype) -> tuple[bool, dict]:
    """`(out_bf16, flags)` of an output kernel writing the quotient in `divide` (None: it
    writes num): the DIVIDE/THR/OUT_BF16 constants, and whether the output tensor is passed
    as its int16 view (bf16 is stored as rounded bits: a store that converts truncates under
    the interpreter)."""
    if divide is None:
        return False, {}
    out_bf16 = divide == torch.bfloat16
    return out_bf16, dict(DIVIDE=True, THR=underflow_threshold(acc), OUT_BF16=out_bf16)


def dv_in_bf16(v: Tensor, dt: torch.dtype) -> bool:
    """Whether a gradient kernel writes dv in bf16 itself: a bf16 v with wider features gets
    the float32 dv rounded once in the kernel, as torch would round it (no float32 dv at all)."""
    return v.dtype == torch.bfloat16 and dt != torch.bfloat16


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation (and state) dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compile_opaque(name: str, fn, fake):
    """`fn` (whose arguments start with a tensor on the launch device) as the custom op
    `fastrpe::name`, which `torch.compile` keeps as one call: Dynamo cannot trace the Triton
    interpreter's kernels, and a compiled graph needs the outputs' shapes without running
    them (`fake`, called with the same arguments, gives them). Returns the function to call:
    the op under compile, fn itself otherwise (the dispatcher's custom-op overhead is not
    paid eagerly, where each launch's host time counts at short lengths). fn returns None for
    an output the call does not make; the op returns an empty tensor of the first argument's
    dtype there (an op's outputs are tensors), as `fake` must. A torch that cannot register
    the op keeps eager calls working; a compiled call then says why it cannot run."""
    fn = on_device_of(0)(fn)

    @functools.wraps(fn)
    def as_op(*args):
        return tuple(args[0].new_empty(0) if t is None else t for t in fn(*args))

    try:
        op = torch.library.custom_op(f"fastrpe::{name}", mutates_args=())(as_op)
        op.register_fake(fake)
        overload, why = op._opoverload, None
    except Exception as e:  # noqa: BLE001  # pragma: no cover - depends on the torch version
        overload, why = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    @functools.wraps(fn)
    def call(*args):
        if not torch.compiler.is_compiling():
            return fn(*args)
        if overload is None:
            raise FastRPEError(f"fastrpe::{name}: the Triton kernels cannot run under torch.compile with this "
                               f"torch ({torch.__version__}): registering their custom op failed ({why})")
        return overload(*args)

    return call


def _chunk_sizes(phi_q: Tensor, v: Tensor, q_offset: int, chunk: int) -> tuple[int, int, int, int, int]:
    """`(BT, BF, BDV, BVS, N)`: the chunk, the feature and value tiles, the state passes'
    value block and the number of chunks."""
    Lq, F = phi_q.shape[2], phi_q.shape[3]
    Lk, Dv = v.shape[2], v.shape[3]
    BDV = _pow2(Dv)
    # the state passes are sequential over chunks: narrow value blocks for more programs
    # (B·H alone is 8 programs at B=1, H=8)
    return chunk, _pow2(F), BDV, min(BDV, 16), -(-max(Lk, q_offset + Lq) // chunk)


def _chunked_forward(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_g: Tensor, init: Tensor | None, q_offset: int,
                     chunk: int, strict: bool, out_dtype: torch.dtype, mode: int, divide: torch.dtype | None,
                     state_dtype: torch.dtype | None, want_state: bool, scan: str
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`(num, den, state, h, z)` of `_ChunkedDecay` (state None unless `want_state`; h, z the
    chunk states its backward reads)."""
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dev, dt = phi_q.device, phi_q.dtype
    acc = acc_dtype(dt)
    BT, BF, BDV, BVS, N = _chunk_sizes(phi_q, v, q_offset, chunk)
    BV = min(BDV, 64)
    # the chunk states between the kernels (each kernel carries its running state in acc)
    h = torch.zeros(B * H, N + 1, BF, BDV, dtype=state_dtype or acc, device=dev)
    z = torch.zeros(B * H, N + 1, BF, dtype=acc, device=dev)
    if init is not None:
        h[:, 0, :F, :Dv] = init[..., :Dv].reshape(B * H, F, Dv)
        z[:, 0, :F] = init[..., Dv].reshape(B * H, F)
    # with `divide` the output kernel writes the quotient in that dtype (from its sums in acc)
    num = torch.empty(B, H, Lq, Dv, dtype=out_dtype if divide is None else divide, device=dev)
    den = torch.empty(B, H, Lq, dtype=out_dtype if divide is None else acc, device=dev)
    meta = dict(DT=_TL_DTYPE[dt], ACC=_TL_DTYPE[acc], MODE=mode)
    out_bf16, quot = quotient_flags(divide, acc)
    _state_pass(lambda nb, h, z, c, cz, G, NB, phase: _fwd_state_kernel[(B * H, BDV // BVS, nb)](
        phi_k, v, log_g, h, z, c, cz, H, Lk, F, Dv, N, G, NB, BT=BT, BF=BF, BV=BVS, BDV=BDV, PHASE=phase, **meta),
        h, z, log_g, N, BT, Lk, reverse=False, mode=scan, programs=B * H * (BDV // BVS))
    _fwd_out_kernel[(N, B * H, BDV // BV)](phi_q, phi_k, v, log_g, h, z, num.view(torch.int16) if out_bf16 else num,
                                           den, H, Lq, Lk, F, Dv, N, q_offset, length_bucket(N),
                                           BT=BT, BF=BF, BV=BV, BDV=BDV, STRICT=strict, **quot, **meta)
    state = torch.cat([h[:, N, :F, :Dv], z[:, N, :F, None]], -1).reshape(B, H, F, Dv + 1) if want_state else None
    return num, den, state, h, z


def _chunked_forward_fake(phi_q, phi_k, v, log_g, init, q_offset, chunk, strict, out_dtype, mode, divide,
                          state_dtype, want_state, scan):
    B, H, Lq, F = phi_q.shape
    Dv = v.shape[3]
    acc = acc_dtype(phi_q.dtype)
    _, BF, BDV, _, N = _chunk_sizes(phi_q, v, q_offset, chunk)
    return (phi_q.new_empty(B, H, Lq, Dv, dtype=out_dtype if divide is None else divide),
            phi_q.new_empty(B, H, Lq, dtype=out_dtype if divide is None else acc),
            phi_q.new_empty(B, H, F, Dv + 1, dtype=acc) if want_state else phi_q.new_empty(0),
            phi_q.new_empty(B * H, N + 1, BF, BDV, dtype=state_dtype or acc),
            phi_q.new_empty(B * H, N + 1, BF, dtype=acc))


def _chunked_backward(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_g: Tensor, h: Tensor, z: Tensor,
                      state: Tensor | None, init: Tensor | None, den: Tensor | None, dnum: Tensor | None,
                      dden: Tensor | None, dstate: Tensor | None, q_offset: int, chunk: int, strict: bool, mode: int,
                      scan: str, want_dlg: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`(dφq, dφk, dv, dlog γ, dinit)` of `_ChunkedDecay` (dlog γ None unless `want_dlg`,
    dinit unless there is an initial state)."""
    return chunked_backward(phi_q, phi_k, v, log_g, h, z, state, init, den, dnum, dden, dstate, q_offset, chunk,
                            strict, mode, scan, want_dlg)


def chunked_backward(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_g: Tensor, h: Tensor, z: Tensor,
                     state: Tensor | None, init: Tensor | None, den: Tensor | None, dnum: Tensor | None,
                     dden: Tensor | None, dstate: Tensor | None, q_offset: int, chunk: int, strict: bool, mode: int,
                     scan: str, want_dlg: bool, maps=None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`_chunked_backward` (the custom op's body), and with `maps` (`triton_chunked_prf.MapGrads`,
    not with `want_dlg`) the PRF maps' backward in its gradient kernels: `(dq, dk, ...)` of the
    maps' inputs, in their dtype, in place of dφq, dφk."""
    B, H, Lq, F = phi_q.shape
    Lk, Dv = v.shape[2], v.shape[3]
    dev, dt = phi_q.device, phi_q.dtype
    acc = acc_dtype(dt)
    BT, BF, BDV, BVS, N = _chunk_sizes(phi_q, v, q_offset, chunk)
    dnum, inv, dden = _numerator_grads(dnum, dden, den, (B, H, Lq, Dv), dt, dev)
    dh = torch.zeros(B * H, N + 1, BF, BDV, dtype=h.dtype, device=dev)
    dz = torch.zeros(B * H, N + 1, BF, dtype=acc, device=dev)
    if dstate is not None:
        dh[:, N, :F, :Dv] = dstate[..., :Dv].reshape(B * H, F, Dv)
        dz[:, N, :F] = dstate[..., Dv].reshape(B * H, F)
    meta = dict(DT=_TL_DTYPE[dt], ACC=_TL_DTYPE[acc], MODE=mode, SCALED=den is not None)
    _state_pass(lambda nb, dh, dz, c, cz, G, NB, phase: _bwd_state_kernel[(B * H, BDV // BVS, nb)](
        phi_q, dnum, inv, dden, log_g, dh, dz, c, cz, H, Lq, Lk, F, Dv, N, G, NB, q_offset,
        BT=BT, BF=BF, BV=BVS, BDV=BDV, PHASE=phase, **meta), dh, dz, log_g, N, BT, Lk, reverse=True, mode=scan,
        programs=B * H * (BDV // BVS))
    dv_bf16 = dv_in_bf16(v, dt)
    dv = torch.empty(B, H, Lk, Dv, dtype=torch.bfloat16 if dv_bf16 else acc, device=dev)
    tiles = dict(BT=BT, BF=BF, BDV=BDV, STRICT=strict, **meta)
    dims = (H, Lq, Lk, F, Dv, N, q_offset)
    if maps is not None:
        from . import triton_chunked_prf as tcp

        if want_dlg:
            raise ValueError("triton_chunked: the decay's gradient needs dφ, which the fused maps do not make")
        dk = tcp.launch_dkv(maps, (N, B * H), (phi_q, phi_k, v, dnum, inv, dden, log_g, dh, dz), dv, dims,
                            length_bucket(N), dv_bf16, tiles)
    else:
        dk = torch.empty(B, H, Lk, F, dtype=acc, device=dev)
        _bwd_dkv_kernel[(N, B * H)](phi_q, phi_k, v, dnum, inv, dden, log_g, dh, dz, dk,
                                    dv.view(torch.int16) if dv_bf16 else dv, *dims, length_bucket(N),
                                    DV_BF16=dv_bf16, **tiles)
    dinit = None
    if init is not None:
        dinit = torch.cat([dh[:, 0, :F, :Dv], dz[:, 0, :F, None]], -1).reshape(B, H, F, Dv + 1)
    cross = None
    if want_dlg:  # (the states' part of dlg, below)
        cross = _state_dots(h[:, 1:], dh[:, 1:]) + (z[:, 1:] * dz[:, 1:]).sum((1, 2), dtype=torch.float64)
    # the states' gradients are spent before dφq is made: the two are never held together
    del dh, dz
    if maps is not None:
        dq = tcp.launch_dq(maps, (N, B * H), (phi_k, v, dnum, inv, dden, log_g, h, z), dims, length_bucket(N), tiles)
        return dq, dk, dv.to(v.dtype), None, dinit.to(init.dtype) if init is not None else None
    dq = torch.empty(B, H, Lq, F, dtype=acc, device=dev)
    _bwd_dq_kernel[(N, B * H)](phi_k, v, dnum, inv, dden, log_g, h, z, dq, *dims, length_bucket(N), **tiles)
    dlg = None
    if want_dlg:
        # every weight is γ^(p_i - j); split p_i - j = (p_i mod T) - (j mod T) + T·(chunks
        # between): the chunk-local parts from the gradients, the crossings from the states,
        # Σ_pairs crossing boundary b = <S_b, dS_b>. (Σ_i p_i φq_i·dφq_i - Σ_j j φk_j·dφk_j is the
        # same sum, but its two terms are L·(1-γ) times larger than it: bf16 products lost it.)
        # The initial state is a key at -1 in chunk 0, the final state a query at Lk-1 in chunk N.
        f64 = torch.float64
        pq = ((torch.arange(Lq, device=dev) + q_offset) % BT).to(f64)
        pk = (torch.arange(Lk, device=dev) % BT).to(f64)
        dlg = ((phi_q.to(acc) * dq).sum(-1).to(f64) * pq).sum((0, 2))
        dlg = dlg - ((phi_k.to(acc) * dk).sum(-1).to(f64) * pk).sum((0, 2))
        dlg = dlg + BT * cross.view(B, H).sum(0)
        if dstate is not None and state is not None:
            dlg = dlg + (Lk - 1 - N * BT) * (state.to(f64) * dstate.to(f64)).sum((0, 2, 3))
        if init is not None:
            dlg = dlg + (init.to(f64) * dinit.to(f64)).sum((0, 2, 3))
        dlg = dlg.to(log_g.dtype)
    return dq.to(dt), dk.to(dt), dv.to(v.dtype), dlg, dinit.to(init.dtype) if init is not None else None


def _chunked_backward_fake(phi_q, phi_k, v, log_g, h, z, state, init, den, dnum, dden, dstate, q_offset, chunk,
                           strict, mode, scan, want_dlg):
    B, H, Lq, F = phi_q.shape
    Lk = v.shape[2]
    return (phi_q.new_empty(B, H, Lq, F), phi_q.new_empty(B, H, Lk, F), torch.empty_like(v),
            log_g.new_empty(log_g.shape) if want_dlg else phi_q.new_empty(0),
            init.new_empty(init.shape) if init is not None else phi_q.new_empty(0))


_chunked_forward_op = compile_opaque("triton_chunked_forward", _chunked_forward, _chunked_forward_fake)
_chunked_backward_op = compile_opaque("triton_chunked_backward", _chunked_backward, _chunked_backward_fake)


class _ChunkedDecay(torch.autograd.Function):
    """`(num, den, state)` of the causal (or strictly causal) geometric-decay recurrence (state
    None unless `want_state`: a call that does not return it does not gather it). Its two
    halves are custom ops under `torch.compile` (`compile_opaque`)."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, v, log_g, init, q_offset: int, chunk: int, strict: bool, out_dtype, mode: int,
                divide=None, state_dtype=None, want_state: bool = False):
        num, den, state, h, z = _chunked_forward_op(phi_q, phi_k, v, log_g, init, q_offset, chunk, strict,
                                                    out_dtype, mode, divide, state_dtype, want_state, STATE_SCAN)
        state = state if want_state else None
        # with `divide` num holds `num/den`: no float32 num is kept; backward takes the quotient's
        # gradient as it comes, scaled by 1/den in the kernels (`_row_inv`), and den's from
        # `_QuotientGrad`, so only den is saved
        ctx.save_for_backward(phi_q, phi_k, v, log_g, h, z, state, init, den if divide is not None else None)
        ctx.cfg = (q_offset, chunk, strict, mode, STATE_SCAN)
        return num, den, state

    @staticmethod
    def backward(ctx, dnum, dden, dstate):
        phi_q, phi_k, v, log_g, h, z, state, init, den = ctx.saved_tensors
        q_offset, chunk, strict, mode, scan = ctx.cfg
        dq, dk, dv, dlg, dinit = _chunked_backward_op(phi_q, phi_k, v, log_g, h, z, state, init, den, dnum, dden,
                                                      dstate, q_offset, chunk, strict, mode, scan,
                                                      ctx.needs_input_grad[3])
        return (dq, dk, dv, dlg if ctx.needs_input_grad[3] else None, dinit if init is not None else None,
                None, None, None, None, None, None, None, None)


#: the largest float64 temporary of `_state_dots` (its blocks of chunks)
STATE_DOT_BLOCK_BYTES = 64 * 2**20


def _state_dots(h: Tensor, dh: Tensor) -> Tensor:
    """`[B·H]` float64 `Σ_{n, f, c} h·dh` of `[B·H, N, BF, BDV]` states in any dtype (bf16
    included: each product in float64, not rounded to bf16), in blocks of chunks."""
    BH, N = h.shape[0], h.shape[1]
    step = max(1, STATE_DOT_BLOCK_BYTES // max(1, 2 * 8 * h[0, 0].numel() * BH))
    out = torch.zeros(BH, dtype=torch.float64, device=h.device)
    for s in range(0, N, step):  # from shapes alone: no host synchronization
        a, b = h[:, s:s + step].to(torch.float64), dh[:, s:s + step].to(torch.float64)
        out += (a * b).sum((1, 2, 3))
    return out


def _quotient_backward(dout: Tensor, out: Tensor, den: Tensor) -> tuple[Tensor, Tensor]:
    """What the gradient of `out = quotient(num, den)` needs in place of `dnum`: `inv = 1/den`
    (0 for an empty row), by which the kernels scale the products of dout row by row
    (`dnum = dout·inv`), and `dden = -inv·Σ_c dout·out` (the output in place of num in
    `-Σ dout·num/den²`), by one kernel that reads both in their dtype and sums in den's: no
    float32 copy of either.

    Args:
        dout, out: `[B, H, Lq, Dv]`, contiguous, any dtype; den: `[B, H, Lq]` float32/64.

    Returns:
        `(inv, dden)`, `[B, H, Lq]` each in den's dtype."""
    den = den.contiguous()
    inv, dd = torch.empty_like(den), torch.empty_like(den)
    R, Dv = den.numel(), out.shape[-1]
    BR = 64
    _quotient_dd_kernel[(triton.cdiv(R, BR),)](dout, out.contiguous(), den, inv, dd, R, Dv, BR=BR,
                                               BC=min(_pow2(Dv), 128), ACC=_TL_DTYPE[den.dtype],
                                               THR=underflow_threshold(den.dtype), DD=True)
    return inv, dd


def inverse_rows(den: Tensor) -> Tensor:
    """`safe_inverse(den)` (`1/den`, 0 where `|den|` is below `underflow_threshold`) in one
    launch, contiguous: what the backward kernels scale a quotient's gradient by (`_row_inv`)."""
    den = den.contiguous()
    inv = torch.empty_like(den)
    R, BR = den.numel(), 64
    _quotient_dd_kernel[(triton.cdiv(R, BR),)](den, den, den, inv, inv, R, 0, BR=BR, BC=16,
                                               ACC=_TL_DTYPE[den.dtype], THR=underflow_threshold(den.dtype),
                                               DD=False)
    return inv


def _quotient_backward_fake(dout, out, den):
    return torch.empty_like(den), torch.empty_like(den)


quotient_backward = compile_opaque("quotient_backward", _quotient_backward, _quotient_backward_fake)


class _QuotientGrad(torch.autograd.Function):
    """The identity on a quotient `out = num/den` that an output kernel wrote; its backward
    forms the denominator's gradient `-inv·Σ_c dout·out` (`quotient_backward`) and hands it to
    den, with dout to out as it came. The kernels' own backward then needs den, not out: out is
    freed once this node has run, before they do (128 B per head and token at their peak in
    bf16 with Dv = 64; a layer's output is kept from forward to backward either way)."""

    @staticmethod
    def forward(ctx, out, den):
        ctx.save_for_backward(out, den)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):  # its one launch is quotient_backward's, which picks the device
        out, den = ctx.saved_tensors
        dout = dout.contiguous()
        return dout, quotient_backward(dout, out, den)[1]


def with_quotient_grad(out: Tensor, den: Tensor) -> Tensor:
    """`out` (the quotient an autograd function returned with den) through `_QuotientGrad`,
    which gives den its gradient from out's."""
    return _QuotientGrad.apply(out, den) if torch.is_grad_enabled() and out.requires_grad else out


def _numerator_grads(dnum, dden, den, shape, dt, dev) -> tuple[Tensor, Tensor, Tensor]:
    """`(dy, inv, dd)` for the backward kernels: dy the gradient they read for the numerator;
    for a quotient (den given) dy is the quotient's gradient as it comes, which they scale by
    `inv = 1/den`, and dd den's gradient (`_QuotientGrad` formed it from the quotient's);
    otherwise inv is a placeholder. The kernels round dy to the input dtype only where it
    enters a tl.dot."""
    B, H, Lq, Dv = shape
    dnum = torch.zeros(B, H, Lq, Dv, dtype=dt, device=dev) if dnum is None else dnum.contiguous()
    if den is not None:
        inv = inverse_rows(den)
        return dnum, inv, torch.zeros_like(inv) if dden is None else dden.to(inv.dtype).contiguous()
    dden = torch.zeros(B, H, Lq, dtype=dt, device=dev) if dden is None else dden.contiguous()
    return dnum, dden, dden


def _prepare(phi_q, phi_k, v, gamma, key_padding_mask, chunk_size):
    if not HAS_TRITON:
        raise FastRPEError("the triton kernels need triton: pip install 'fastrpe[triton]'")
    why = triton_unavailable_reason(phi_q.device)
    if why is not None:
        raise FastRPEError(f"phi_q: the triton kernels cannot run on {phi_q.device}: {why}")
    dt = phi_q.dtype
    if dt not in _TL_DTYPE:
        raise FastRPEError(f"phi_q: dtype {dt} is not supported (float16, bfloat16, float32, float64)")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise FastRPEError(f"chunk_size: must be a power of two >= 16 (tl.dot), got {chunk_size}")
    if v.shape[2] < 1:
        raise FastRPEError("v: needs at least one key")
    H = phi_q.shape[1]
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    acc = acc_dtype(dt)
    if gamma is None:
        log_g = torch.zeros(H, dtype=acc, device=phi_q.device)
    else:
        if gamma.shape != (H,):
            raise FastRPEError(f"gamma: expected shape ({H},), got {tuple(gamma.shape)}")
        log_g = torch.log(gamma.to(acc))
    return phi_q.contiguous(), phi_k.to(dt).contiguous(), v.to(value_dtype(v, dt)).contiguous(), log_g.contiguous()


def kernelized_num_den_triton_chunked(
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
    out_dtype: torch.dtype | None = None,
    precision: str = "ieee",
    divide: torch.dtype | None = None,
    state_dtype: torch.dtype | None = None,
):
    """Causal `num`, `den` (and `log_scale`, all zeros) with weights `γ_h^(p_i - j)`, `j <= p_i`:
    the contract of `kernelized_num_den_chunked`, by Triton kernels (forward and backward).

    Args:
        phi_q: `[B, H, Lq, F]` at positions `q_offset + 0..Lq-1`; phi_k: `[B, H, Lk, F]`;
            v: `[B, H, Lk, Dv]` (read as it comes if bf16/fp16, else in phi_q's dtype).
        gamma: `[H]` decays in (0, 1] (differentiable), or None for 1.
        key_padding_mask: `[B, Lk]` bool, True = padding.
        chunk_size: T, a power of two >= 16.
        initial_state: `[B, H, F, Dv+1]` state of keys before position 0 (differentiable).
        return_state: also return the state after key Lk - 1.
        out_dtype: dtype of num and den (default phi_q's; float32 keeps the fp32 sums of
            bf16 features unrounded).
        precision: how float32 features are multiplied on the GPU (`PRECISIONS`): "ieee"
            exactly, "tf32x3" on the tensor cores at about float32's accuracy.
        divide: a dtype: return `num/den` in it (rows without weight 0, as `safe_divide`)
            in place of num, from the sums in the accumulation dtype. Backward reads the
            quotient's gradient as it comes (no float32 copy of num kept, no float32 gradient
            of num made; the quotient itself is freed before the kernels run,
            `_QuotientGrad`).
        state_dtype: storage of the chunk states between the kernels (default the
            accumulation dtype; bfloat16 halves them: 1.07 GiB at L = 1M, B·H = 8, F = 32,
            Dv = 64 in float32). Each kernel carries its running state in the accumulation
            dtype, so roundings do not compound from chunk to chunk. A call with an
            `initial_state` or `return_state` keeps the accumulation dtype: the states it
            passes on are not rounded.

    Returns:
        `(num [B, H, Lq, Dv], den [B, H, Lq], log_scale [H, Lq])` in out_dtype (+ `state
        [B, H, F, Dv+1]` in the accumulation dtype, float32 or float64, if asked); with
        `divide`, the quotient in that dtype in place of num, den in the accumulation dtype.
    """
    B, H, Lq, F = phi_q.shape
    Dv = v.shape[3]
    q, k, vv, log_g = _prepare(phi_q, phi_k, v, gamma, key_padding_mask, chunk_size)
    if initial_state is not None:
        if initial_state.shape != (B, H, F, Dv + 1):
            raise FastRPEError(f"initial_state: expected shape {(B, H, F, Dv + 1)}, got {tuple(initial_state.shape)}")
        initial_state = initial_state.to(acc_dtype(q.dtype))
    if initial_state is not None or return_state:
        state_dtype = None
    num, den, state = _ChunkedDecay.apply(q, k, vv, log_g, initial_state, int(q_offset), chunk_size, False,
                                          out_dtype or phi_q.dtype, dot_mode(precision), divide, state_dtype,
                                          return_state)
    if divide is not None:
        num = with_quotient_grad(num, den)
    out = (num, den, phi_q.new_zeros(H, Lq))
    return (*out, state) if return_state else out


def kernelized_num_den_triton_bidirectional(
    phi_q: Tensor,
    phi_k: Tensor,
    v: Tensor,
    *,
    gamma: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    out_dtype: torch.dtype | None = None,
    precision: str = "ieee",
    state_dtype: torch.dtype | None = None,
):
    """Non-causal `num_i = Σ_j γ_h^|i-j| (φq_i·φk_j) v_j` (and `den`, `log_scale` zeros) in
    linear time: the causal scan (`j <= i`) plus the strictly causal scan of the reversed
    sequences (`j > i`); exact, no term is counted twice. `Lq == Lk`, no q_offset.

    Args and Returns as `kernelized_num_den_triton_chunked` (no states in or out, so
    `state_dtype` always applies)."""
    B, H, Lq, F = phi_q.shape
    Lk = v.shape[2]
    if Lq != Lk:
        raise FastRPEError(f"phi_q: the bidirectional decay kernel needs Lq == Lk, got Lq={Lq}, Lk={Lk}")
    q, k, vv, log_g = _prepare(phi_q, phi_k, v, gamma, key_padding_mask, chunk_size)
    od, mode = out_dtype or phi_q.dtype, dot_mode(precision)
    n1, d1, _ = _ChunkedDecay.apply(q, k, vv, log_g, None, 0, chunk_size, False, od, mode, None, state_dtype)
    rev = (q.flip(2).contiguous(), k.flip(2).contiguous(), vv.flip(2).contiguous())
    n2, d2, _ = _ChunkedDecay.apply(*rev, log_g, None, 0, chunk_size, True, od, mode, None, state_dtype)
    return n1 + n2.flip(2), d1 + d2.flip(2), phi_q.new_zeros(H, Lq)
