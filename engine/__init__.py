"""Kestrel's engine: load and patch models, LoRA/QLoRA/full SFT and GRPO, decode, export.

    from engine.loader import load
    from engine.train import run
"""
