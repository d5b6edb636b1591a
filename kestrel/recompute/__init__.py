"""The recompute room: activation checkpointing (recompute, or offload to pinned host memory) and
per-layer CUDA graphs, used where timing both ways finds them faster."""
