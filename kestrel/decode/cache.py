"""A static, pre-allocated KV cache: one allocation, fixed shapes, written in place.

Layout (gpt-fast's): for every layer a K and a V tensor of shape `(B, kv_heads, S, head_dim)`,
all views into one buffer of shape `(layers, 2, B, kv_heads, S, head_dim)`. Shapes and addresses
never change while the cache lives, which is what lets a CUDA graph captured once replay every
decode step.

Rows are LEFT-padded: every row of a batch writes the same cache column at each step, so a step
writes one column (`k[i][:, :, col] = k_new`, `col` a 1-element device tensor: no host read) and
the attention mask, built from each row's pad count, hides the pad columns. A row's RoPE
position at column `c` is `c - pad[row]`.

The buffer starts zeroed and every write is finite, so masked columns never hold NaN or Inf
(a masked probability of exactly 0 times a NaN value would still be NaN).
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """K/V for `layers` layers, `batch` rows and `length` columns, allocated once.

    `k[i]`, `v[i]`: (B, kv_heads, S, head_dim) views for layer i.
    """

    def __init__(
        self,
        layers: int,
        batch: int,
        kv_heads: int,
        length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.batch, self.length = batch, length
        self.buffer = torch.zeros((layers, 2, batch, kv_heads, length, head_dim), dtype=dtype, device=device)
        self.k = [self.buffer[i, 0] for i in range(layers)]
        self.v = [self.buffer[i, 1] for i in range(layers)]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def write_prefix(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prefill: k, v (B, kv_heads, T, head_dim) -> columns [0, T)."""
        t = k.shape[2]
        self.k[layer][:, :, :t].copy_(k)
        self.v[layer][:, :, :t].copy_(v)
