"""Kestrel: fine-tune LLMs (LoRA, QLoRA, full SFT, GRPO) on fused kernels, decode fast, export GGUF.

    from kestrel.config import load_config
    from kestrel.training.run import run
    result = run(load_config("run.yaml"))

The rooms: `kernels/` (Triton ops), `model/` (families, loading, patching), `recompute/`
(checkpointing, offload, CUDA graphs), `training/` (the recipes), `data/`, `decode/`, `export/`,
`jobs/` (the job store and workers), `studio/` (the Gradio app), `cli/` (`python -m kestrel`).
"""
