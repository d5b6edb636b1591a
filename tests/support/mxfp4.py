"""A tiny gpt-oss checkpoint with its experts stored as the real ones are: MXFP4 blocks and scales.

MXFP4 (OCP microscaling): each run of 32 values along a row's input dimension shares one 8-bit
exponent (bias 127); each value is a 4-bit e2m1 code, two codes a byte (low nibble first). Weights
are drawn as exact MXFP4 values, so dequantizing must give them back bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _mxfp4(shape: tuple[int, ...], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(value (E, in, out) fp32, blocks (E, out, in/32, 16) uint8, scales (E, out, in/32) uint8)."""
    e, n_in, n_out = shape
    codes = torch.randint(0, 16, (e, n_out, n_in), generator=g)
    exps = torch.randint(-6, -2, (e, n_out, n_in // 32), generator=g)
    value = torch.tensor(E2M1)[codes] * torch.pow(2.0, exps.repeat_interleave(32, dim=-1).float())
    pairs = codes.view(e, n_out, n_in // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return value.transpose(1, 2).contiguous(), blocks, (exps + 127).to(torch.uint8)


def write_mxfp4_gpt_oss(model: torch.nn.Module, folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Save `model` (a tiny gpt-oss) to `folder` with MXFP4 experts; returns the expert weights
    the checkpoint holds, by parameter name, as HF lays them out once dequantized."""
    g = torch.Generator().manual_seed(seed)
    model.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    expected: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            expected[name], blocks, scales = _mxfp4(tuple(param.shape), g)
            del weights[name]
            weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return expected
