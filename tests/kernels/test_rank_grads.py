"""kestrel.kernels.lora.rank_grads: an adapter's dy B and dy^T xa in one pass over dy, against the two
products in fp64, on shapes that leave partial tiles, several column blocks and row groups (or one of
each), ranks that are not a power of two, and strided operands (xa a slice of a group's stacked products)."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels.lora.rank_grads import _grid, rank_grads
from tests.kernels.tolerance import assert_close


def _case(m: int, n: int, r: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(m, n, generator=g).to(dtype)
    b = (torch.randn(n, r, generator=g) / 8).to(dtype)
    stacked = torch.randn(m, 3 * r, generator=g).to(dtype)  # (M, 3r): this projection's xa is its middle block
    return dy, b, stacked[:, r:2 * r]


@pytest.mark.parametrize(("m", "n", "r"), [(70, 300, 8), (20, 96, 16), (130, 520, 24), (33, 256, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_gives_both_products(backend: str, poisoned: None, m: int, n: int, r: int, dtype: torch.dtype) -> None:
    dy, b, xa = _case(m, n, r, dtype)
    assert not xa.is_contiguous()
    dyb, db = rank_grads(dy, b, xa)
    assert dyb.dtype == dtype and db.dtype == torch.float32 and db.is_contiguous()
    assert_close(dyb, (dy.double() @ b.double()).to(dtype), tight=dtype == torch.float32)
    assert_close(db, (dy.double().t() @ xa.double()).float(), tight=dtype == torch.float32)


def test_a_transposed_gradient_is_read_through_its_strides(backend: str) -> None:
    dy, b, xa = _case(40, 300, 16, torch.float32, seed=1)
    dyt = dy.t().contiguous().t()  # the same values, column-major
    for got, want in zip(rank_grads(dyt, b, xa), rank_grads(dy, b, xa)):
        assert_close(got, want)


def test_the_grid_fills_the_device_and_covers_every_row() -> None:
    """Row groups are whole steps, cover M, and bring the programs near two a multiprocessor (4 off CUDA)."""
    for m, n in [(8192, 2048), (8192, 512), (8192, 8192), (100, 300), (1, 64), (65536, 14336), (12345, 3584)]:
        groups, cols, steps = _grid(m, n, torch.device("cpu"))
        rows = steps * 32
        assert groups * rows >= m and (groups - 1) * rows < m
        assert cols == -(-n // 256)
        assert groups * cols >= min(8, -(-m // 32) * cols) * 0.8  # near as many as the rows allow, up to two waves
    assert len({_grid(m, 2048, torch.device("cpu"))[2] for m in range(4096, 8193, 7)}) <= 5  # few trip counts


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "r"), [(4096, 512, 16), (8192, 2048, 16), (2048, 8192, 16), (4096, 3584, 32),
                                           (1000, 896, 8)])
def test_one_pass_gives_both_products_on_cuda(m: int, n: int, r: int) -> None:
    """Compiled for the GPU at the shapes a step meets (a deferred MLP's 2,048-row chunks among them), bf16
    operands as training has them: within bf16's rounding of dy B, and dB as close as cuBLAS's fp32 product."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dy, b, xa = (t.cuda() for t in _case(m, n, r, torch.bfloat16, seed=2))
    dyb, db = rank_grads(dy, b, xa)
    assert_close(dyb, (dy.double() @ b.double()).to(torch.bfloat16), tight=False)
    exact = dy.double().t() @ xa.double()
    cublas = torch.mm(dy.t(), xa, out_dtype=torch.float32)
    assert (db.double() - exact).abs().max() <= 2 * (cublas.double() - exact).abs().max() + 1e-4 * exact.abs().max()


def test_high_ranks_take_the_two_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """At rank 64 the one pass's slabs would cost what it saves (`_one_pass_pays`): the products run instead."""
    from kestrel.kernels.lora import rank_grads as module

    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    ran = []
    monkeypatch.setattr(module, "launch", lambda *a, **k: ran.append(a))
    dy, b, xa = _case(40, 300, 64, torch.float32)
    module.rank_grads(dy, b, xa)
    assert ran == [] and module._one_pass_pays(32) and not module._one_pass_pays(64)


def test_the_kernel_compiles_for_sm90_on_tensor_cores_without_spilling() -> None:
    """The default tiles for 16-bit operands at ranks 16 and 32 and for fp32 (exact products), through Triton and
    ptxas for an H100/H200 (no GPU needed; its own process, uninterpreted; unit strides and alignment specialized as
    a launch has them): 16-bit operands take tensor-core instructions, fp32 none, the tiles of dy are copied ahead
    into shared memory (cp.async: the loop is pipelined, which a memory-bound pass needs), and nothing spills."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.support.sm90_compile", "rank_grads"], capture_output=True,
                          text=True, env=env, cwd=Path(__file__).resolve().parents[2], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.strip().splitlines()[-4:]]
    assert [(dtype, int(rp)) for dtype, rp, *_ in rows] == [("bf16", 16), ("bf16", 32), ("fp16", 16), ("fp32", 16)]
    for dtype, _, mma, _, spilled, copied_ahead in rows:
        assert (int(mma) > 0) == (dtype != "fp32") and int(spilled) == 0 and int(copied_ahead) > 0, rows
