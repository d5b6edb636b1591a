"""Just-in-time NF4 dequantization of bitsandbytes 4-bit weights into a reused workspace.

The packed format (bitsandbytes `Params4bit`, `quant_type="nf4"`):
- `weight`: uint8, `numel = ceil(n / 2)` for an `(out, in)` matrix of `n = out * in` elements in
  row-major order; element `2j` sits in the HIGH nibble of byte `j`, element `2j + 1` in the low.
- `quant_state.code`: the 16 NF4 levels (float32), indexed by the nibble.
- `quant_state.absmax`: one scale per block of `blocksize` (64) elements. With double quant
  (`quant_state.nested`) it is itself uint8, decoded as
  `absmax[b] = state2.code[q[b]] * state2.absmax[b // state2.blocksize] + offset` (fp32, the
  multiply and the add rounded separately, as bitsandbytes does).
- `W[i] = dtype(code[nibble(i)] * absmax[i // blocksize])`, computed in fp32, rounded once.

The dequantized matrix is written into ONE flat buffer per (device, dtype), grown to the largest
weight seen, so a training step re-dequantizes every layer without allocating (one 14336 x 4096
bf16 buffer, 117 MB, serves all seven Llama projections instead of one buffer per shape). The
returned view is valid until the next `dequantize` on that device and dtype; kernels on one
stream run in order, so a matmul enqueued before the next dequantize still reads the old values.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from kestrel.kernels._launch import launch
from kestrel.kernels.dispatch import use_triton

# The 16 NF4 levels (QLoRA, Dettmers et al. 2023), exactly as bitsandbytes stores them in fp32.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip

# Quant blocks per program (32 x 64 = 2048 output elements), on 2 warps: the fastest in a sweep
# over {16, 32, 64, 128} blocks and {2, 4, 8} warps, and ahead of bitsandbytes' kernel
# (`python bench/nf4_tiles.py`; bench/RESULTS.md, QLoRA "Session 7").
_ROWS = 32


@triton.jit
def block_scales(
    absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, blk, mask, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
    ADD_RN: tl.constexpr = False,
):
    """fp32 absmax of the quant blocks `blk` (any shape): read directly, or decoded from double
    quantization as code2[q] * absmax2[blk // BLOCKSIZE2] + offset, the add rounded apart from the
    multiply as bitsandbytes does: launch with enable_fp_fusion=False, or (a kernel launched where
    that option cannot be passed, e.g. inside torch.compile; compiled CUDA only) ADD_RN: the add as
    PTX `add.rn.f32`, which is never contracted into an FMA."""
    if NESTED:
        q = tl.load(absmax_ptr + blk, mask=mask, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + blk // BLOCKSIZE2, mask=mask)
        if ADD_RN:
            offset = tl.broadcast_to(tl.load(offset_ptr), scale.shape)
            scale = tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [scale, offset], dtype=tl.float32,
                                              is_pure=True, pack=1)
        else:
            scale = scale + tl.load(offset_ptr)
    else:  # one return at the end: the compiler rejects a return inside the branch
        scale = tl.load(absmax_ptr + blk, mask=mask, other=0.0)
    return scale


@triton.jit
def decode_bytes(packed, code_ptr):
    """(..., 2 m) fp32 NF4 levels of (..., m) packed bytes: byte j holds element 2j in its HIGH
    nibble and 2j + 1 in its low one."""
    hi = tl.load(code_ptr + (packed >> 4).to(tl.int32))
    lo = tl.load(code_ptr + (packed & 15).to(tl.int32))
    return tl.join(hi, lo)  # (..., m, 2): interleaved as elements 2j, 2j + 1


@triton.jit
def _nf4_dequant_kernel(
    w_ptr,  # uint8, (ceil(n / 2),) packed nibbles
    code_ptr,  # fp32, (16,) NF4 levels
    absmax_ptr,  # fp32 (n_blocks,), or uint8 when NESTED
    code2_ptr,  # fp32 (256,) second-level code (NESTED only)
    absmax2_ptr,  # fp32 (ceil(n_blocks / BLOCKSIZE2),) second-level scales (NESTED only)
    offset_ptr,  # fp32 (1,) mean subtracted before the second quantization (NESTED only)
    out_ptr,  # 16/32-bit, (n,) row-major output
    n,
    n_blocks,
    BLOCKSIZE: tl.constexpr,
    BLOCKSIZE2: tl.constexpr,
    NESTED: tl.constexpr,
    ROWS: tl.constexpr,
):
    # One program decodes ROWS consecutive quant blocks, laid out as a (ROWS, BLOCKSIZE) tile.
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,) quant-block indices
    row_mask = rows < n_blocks
    scale = block_scales(absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, rows, row_mask, BLOCKSIZE2, NESTED)
    half = tl.arange(0, BLOCKSIZE // 2)
    byte_idx = rows[:, None] * (BLOCKSIZE // 2) + half[None, :]  # (ROWS, BLOCKSIZE / 2)
    packed = tl.load(w_ptr + byte_idx, mask=byte_idx * 2 < n, other=0)
    vals = tl.reshape(decode_bytes(packed, code_ptr), (ROWS, BLOCKSIZE)) * scale[:, None]
    idx = rows[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]
    tl.store(out_ptr + idx, vals.to(out_ptr.dtype.element_ty), mask=idx < n)


def _shape(quant_state: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in quant_state.shape)


def _numel(quant_state: Any) -> int:
    numel = 1
    for d in _shape(quant_state):
        numel *= d
    return numel


def _code(quant_state: Any, device: torch.device) -> torch.Tensor:
    """The 16-entry NF4 table (fp32) on `device`; bitsandbytes keeps it in `quant_state.code`."""
    code = getattr(quant_state, "code", None)
    if code is None or code.numel() != 16:
        return _default_code(torch.device(device))
    return code.to(device=device, dtype=torch.float32)  # no copy when already there


@functools.lru_cache(maxsize=None)
def _default_code(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def _check(weight: torch.Tensor, quant_state: Any) -> None:
    if getattr(quant_state, "quant_type", "nf4") != "nf4":
        raise ValueError(f"only NF4 is supported, got quant_type={quant_state.quant_type!r}")
    if weight.dtype != torch.uint8:
        raise ValueError(f"packed 4-bit weight must be uint8, got {weight.dtype}")
    if weight.numel() * 2 < _numel(quant_state):
        raise ValueError(f"{weight.numel()} packed bytes are too few for {_shape(quant_state)}")


class _Workspace:
    """One flat buffer per (device, dtype), grown to the largest request and then reused.

    `generation` counts the buffers made: a CUDA graph that captured a dequantization reads the
    buffer it saw, so graphs are keyed on it. Growing during a capture raises: the new buffer
    would come from the graph's private memory pool."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.generation = 0

    def get(self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        key = (torch.device(device), dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the NF4 workspace cannot grow during CUDA graph capture")
            self._buffers.pop(key, None)  # free the smaller one before allocating the larger
            buf = torch.empty(numel, device=device, dtype=dtype)
            self._buffers[key] = buf
            self.generation += 1
        return buf[:numel].view(shape)

    def clear(self) -> None:
        self._buffers.clear()
        self.generation += 1


WORKSPACE = _Workspace()


def dequantize_reference(
    weight: torch.Tensor, quant_state: Any, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Plain-PyTorch NF4 dequantization: `weight` uint8 packed -> `quant_state.shape` in `dtype`
    (default `quant_state.dtype`). Allocates; used on CPU and as the test oracle."""
    _check(weight, quant_state)
    dtype = dtype or quant_state.dtype
    n, bs, device = _numel(quant_state), int(quant_state.blocksize), weight.device
    packed = weight.reshape(-1)
    nibbles = torch.stack((packed >> 4, packed & 15), dim=-1).reshape(-1)[:n].long()  # (n,)
    n_blocks = (n + bs - 1) // bs
    absmax = _absmax_reference(quant_state, n_blocks, device)  # (n_blocks,) fp32
    scale = absmax.repeat_interleave(bs)[:n]
    vals = _code(quant_state, device)[nibbles] * scale
    return vals.to(dtype).view(_shape(quant_state))


def _absmax_reference(quant_state: Any, n_blocks: int, device: torch.device) -> torch.Tensor:
    absmax = quant_state.absmax.reshape(-1)[:n_blocks]
    if not getattr(quant_state, "nested", False):
        return absmax.to(device=device, dtype=torch.float32)
    state2 = quant_state.state2
    code2 = state2.code.to(device=device, dtype=torch.float32)
    scale2 = state2.absmax.to(device=device, dtype=torch.float32)
    scale2 = scale2.repeat_interleave(int(state2.blocksize))
    decoded = code2[absmax.long()] * scale2[:n_blocks]  # rounded, then offset added: no FMA
    return decoded + quant_state.offset.to(device=device, dtype=torch.float32)


def dequantize(
    weight: torch.Tensor,
    quant_state: Any,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Dequantize a bitsandbytes NF4 weight to `quant_state.shape` (`(out, in)`).

    weight: uint8 packed nibbles (a `Params4bit` or its data), quant_state: its `QuantState`.
    out: destination of shape `quant_state.shape`; when None, a view of the shared workspace for
    (device, dtype) is returned (valid until the next call on that device and dtype).
    dtype: output dtype when `out` is None (default `quant_state.dtype`).
    Triton on CUDA (or with KESTREL_KERNELS=triton); the PyTorch reference otherwise.
    """
    plan = _plan(weight, quant_state)
    packed = plan.tensors[0]  # a plain tensor: a Params4bit's .device would go through its __torch_function__
    out = output_buffer(plan, out, (dtype or quant_state.dtype) if out is None else out.dtype)
    if not use_triton(packed):
        return out.copy_(dequantize_reference(weight, quant_state, out.dtype))
    launch(_nf4_dequant_kernel, plan.grid, *plan.tensors, out, plan.n, plan.n_blocks, plan.blocksize,
           plan.blocksize2, plan.nested, _ROWS, num_warps=2, enable_fp_fusion=False)
    return out


class _Plan(NamedTuple):
    """Everything a weight's dequantization launch needs but the output buffer, derived once per
    weight (reading a `Params4bit`'s attributes goes through its __torch_function__, which cost
    more host time than the launch)."""

    weight: weakref.ref  # the tensor the plan was made for (identity check)
    state: int  # id() of its quant_state (a copied quant_state carries the attribute along)
    shape: tuple[int, ...]
    grid: tuple[int]
    tensors: tuple  # packed (plain alias), code, absmax, code2, absmax2, offset: the kernels' first six
    n: int  # elements
    n_blocks: int
    blocksize: int
    blocksize2: int  # of the nested absmax (1 when not nested)
    nested: bool


def output_buffer(plan: _Plan, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Where a dequantization of `plan`'s weight goes: `out`, checked (contiguous, the weight's
    shape, `dtype`), or else a view of the shared workspace for (device, dtype)."""
    if out is None:
        return WORKSPACE.get(plan.shape, plan.tensors[0].device, dtype)
    if tuple(out.shape) != plan.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {dtype} of shape {plan.shape}, got {out.dtype} {tuple(out.shape)}")
    return out


def _plan(weight: torch.Tensor, quant_state: Any) -> _Plan:
    """The cached plan for (weight, quant_state); kept on the quant_state, which lives as long as
    the weight (a new quantization or a device move makes a new quant_state)."""
    plan = getattr(quant_state, "_kestrel_nf4_plan", None)
    if plan is not None and plan.weight() is weight and plan.state == id(quant_state):
        return plan
    _check(weight, quant_state)
    n, bs, device = _numel(quant_state), int(quant_state.blocksize), weight.device
    n_blocks = (n + bs - 1) // bs
    code = _code(quant_state, device)
    nested = bool(getattr(quant_state, "nested", False))
    if nested:
        state2 = quant_state.state2
        absmax, code2, absmax2 = quant_state.absmax, state2.code, state2.absmax
        offset, bs2 = quant_state.offset.reshape(1), int(state2.blocksize)
    else:
        absmax, code2, absmax2, offset, bs2 = quant_state.absmax, code, code, code, 1
    packed = torch.Tensor.as_subclass(weight, torch.Tensor)  # same storage, plain tensor
    plan = _Plan(weakref.ref(weight), id(quant_state), _shape(quant_state), (triton.cdiv(n_blocks, _ROWS),),
                 (packed, code, absmax, code2, absmax2, offset), n, n_blocks, bs, bs2, nested)
    try:
        quant_state._kestrel_nf4_plan = plan
    except AttributeError:  # a quant_state with __slots__: no caching, still correct
        pass
    return plan


def _bench() -> None:
    """`python -m kestrel.kernels.nf4` on a GPU: this kernel vs bitsandbytes' CUDA dequantize_4bit, both
    writing into a preallocated bf16 buffer, at Llama-3.1-8B projection shapes."""
    import bitsandbytes.functional as bnbf

    for shape in [(14336, 4096), (4096, 14336), (4096, 4096), (1024, 4096)]:
        w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        packed, state = bnbf.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
        out = torch.empty_like(w)
        moved = packed.numel() + w.numel() * 2  # bytes read + written (scales are negligible)
        ms_ours = triton.testing.do_bench(lambda p=packed, s=state, o=out: dequantize(p, s, out=o))
        ms_bnb = triton.testing.do_bench(lambda p=packed, s=state, o=out: bnbf.dequantize_4bit(p, s, out=o))
        print(f"{shape}: triton {ms_ours * 1e3:.1f} us ({moved / ms_ours / 1e9:.2f} TB/s)   "
              f"bitsandbytes {ms_bnb * 1e3:.1f} us ({moved / ms_bnb / 1e9:.2f} TB/s)")


if __name__ == "__main__":
    _bench()
