"""The decode step's kernels: batch-1 matrix-vector products (fused with norms, RoPE, cache writes),
decode attention, NF4 products for small batches, mixture-of-experts products read from the stored
experts."""
