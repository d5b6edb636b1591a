"""One QLoRA MLP of the Llama-3.1-8B shape as a checkpointed training step runs it, timed alone.

NF4 gate/up/down (4096 -> 14336 -> 4096), r = 16 adapters in fp32 (PEFT's), 2 x 2048 tokens:
- `first_pass_ms`: the no-grad forward of a checkpointed layer's first pass;
- `recompute_backward_ms`: the recompute (output discarded) and the backward through it;
- `attention_merged_ms`: the no-grad merged Q/K/V and O projections of the same layer.
Median of CUDA-event timings, with the cast adapter copies kept (as between optimizer steps).
Imports `kestrel.kernels` from the working directory, so the same script times another tree:

    python bench/mlp_step.py --out mlp_step.json
    cd old_tree && PYTHONPATH=$PWD python ../bench/mlp_step.py --out ../mlp_step_old.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))

from bench.common import cuda_time  # noqa: E402
from kestrel.kernels.lora.lora import LoRAWeights, lora_linear, lora_qkv  # noqa: E402
from kestrel.kernels.lora.mlp import lora_mlp  # noqa: E402

H, I, R, M = 4096, 14336, 16, 4096


def _weights(o: int, i: int) -> LoRAWeights:
    import bitsandbytes.functional as bnbf

    w = torch.randn(o, i, device="cuda", dtype=torch.bfloat16) / i**0.5
    packed, state = bnbf.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
    a = (torch.randn(R, i, device="cuda") / i**0.5).requires_grad_()
    b = (torch.randn(o, R, device="cuda") * 0.02).requires_grad_()
    return LoRAWeights(packed, state, a, b, 2.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    mlp = [_weights(I, H), _weights(I, H), _weights(H, I)]
    attn = [_weights(4096, H), _weights(1024, H), _weights(1024, H), _weights(H, 4096)]
    x = torch.randn(2, M // 2, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(2, M // 2, H, device="cuda", dtype=torch.bfloat16)
    params = [x, *(t for w in mlp for t in (w.lora_A, w.lora_B))]

    def first_pass() -> None:
        with torch.no_grad():
            lora_mlp(x, *mlp)

    def recompute_backward() -> None:
        y = lora_mlp(x, *mlp, discard_output=True)
        torch.autograd.grad(y, params, dy)

    def attention() -> None:
        with torch.no_grad():
            lora_qkv(x, *attn[:3])
            lora_linear(x, attn[3])

    def ms(fn) -> float:
        return cuda_time(fn, iters=30) * 1e3

    result = {"device": torch.cuda.get_device_name(), "first_pass_ms": ms(first_pass),
              "recompute_backward_ms": ms(recompute_backward), "attention_merged_ms": ms(attention),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    print(json.dumps(result), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
