"""The model folders `bench/matrix.py` trains: random-init at a real config, saved once under /tmp.

A mixture of experts' folder leaves its routed experts' weights out of the checkpoint (Qwen3-30B-A3B:
58 of its 61 GB in bf16, more than the GPU machine's free disk). Loading such a folder, Hugging Face's
`from_pretrained` creates the missing weights on their target device (GPU 0 under a device map, else
the CPU) and initialises them as `from_config` would, with a load report (a warning) that names them.
Their values change neither speed nor memory; everything else (router, attention, embeddings) is saved.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from bench.model_shapes import ARCHITECTURES, MODELS

# On the GPU machine: one folder per model, reused. Two matrix runs at once on one host (one per GPU)
# each take their own root (KESTREL_MATRIX_MODELS): a run removes the other models' folders under its root.
MODEL_ROOT = Path(os.environ.get("KESTREL_MATRIX_MODELS", "/tmp/kestrel-bench/matrix"))
DISK_MARGIN = 2 * 2**30  # bytes left free beyond the checkpoint (the tokenizer, the file system's own)


def model_dir(name: str, root: Path = MODEL_ROOT) -> Path:
    return root / name


def matrix_config(name: str) -> Any:
    """MODELS[name] as a transformers config, its architecture named."""
    from transformers import AutoConfig

    kwargs = dict(MODELS[name])
    model_type = kwargs.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **kwargs)
    cfg.architectures = [ARCHITECTURES[model_type]]
    return cfg


def expert_weight_names(model: Any) -> set[str]:
    """The parameter names of a mixture of experts' routed experts (the `experts` of every block of
    the family's `MoeSpec.block_class`); empty for a dense model."""
    from kestrel.model.registry import family_for

    spec = family_for(model.config)
    if spec is None or spec.moe is None:
        return set()
    return {f"{name}.experts.{p}" for name, module in model.named_modules()
            if type(module).__name__ == spec.moe.block_class for p, _ in module.experts.named_parameters()}


def saved_bytes(model: Any) -> int:
    """Bytes of the weights a folder saves: every parameter but the routed experts' (ties counted once)."""
    skip = expert_weight_names(model)
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in skip)


def check_free_disk(folder: Path, need: int, name: str) -> None:
    """Refuse, before anything is built, when `folder`'s file system has less than `need` bytes
    (plus DISK_MARGIN) free."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need + DISK_MARGIN:
        raise OSError(
            f"building {name} needs about {(need + DISK_MARGIN) / 1e9:.1f} GB free at {probe} "
            f"({need / 1e9:.1f} GB of weights) and {free / 1e9:.1f} GB is free: "
            f"remove other models' folders under {folder.parent} (the matrix does unless --keep-models) "
            "or other large files there")


def build_model_dir(name: str, root: Path = MODEL_ROOT, device: str = "cuda") -> Path:
    """The random-init bf16 folder of MODELS[name] (built on `device` once, with `bench.common`'s
    stand-in tokenizer), its routed experts' weights left out of the checkpoint."""
    return write_model_dir(matrix_config(name), model_dir(name, root), device, name)


def write_model_dir(cfg: Any, folder: Path, device: str, name: str, auto: Any = None) -> Path:
    """`cfg`'s random-init bf16 model saved at `folder` without its routed experts' weights (kept
    when it holds config.json): sized on the meta device first, so a short disk fails before the
    build; written to a sibling and renamed, so a cut-off build leaves no half folder. `auto`: the
    auto class that builds it (AutoModelForCausalLM; an image-text model's AutoModelForImageTextToText)."""
    import torch
    from transformers import AutoModelForCausalLM

    auto = auto or AutoModelForCausalLM

    from bench.common import _save_tokenizer

    if (folder / "config.json").exists():
        return folder
    with torch.device("meta"):
        skeleton = auto.from_config(cfg, dtype=torch.bfloat16)
    check_free_disk(folder, saved_bytes(skeleton), name)
    del skeleton
    with torch.device(device):
        model = auto.from_config(cfg, dtype=torch.bfloat16)
    skip = expert_weight_names(model)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict={k: v for k, v in model.state_dict().items() if k not in skip})
    _save_tokenizer(tmp)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    os.replace(tmp, folder)
    return folder
