"""Fused LoRA kernels: linear, q/k/v and the GLU MLP with hand-written backward passes, their cast cache and NF4 bases."""
