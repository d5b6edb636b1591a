"""Where a training step's GPU time goes: torch.profiler over a few steps of one implementation.

    python bench/profile_train.py --impl kestrel --method qlora --out prof.txt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.common import LLAMA_8B, llama8b_dir, random_batch  # noqa: E402
from bench.train import build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="kestrel")
    ap.add_argument("--method", default="qlora")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--checkpointing", default="standard")
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = build(args.impl, llama8b_dir(), args)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    ids, labels = random_batch(args.batch, args.seq, LLAMA_8B["vocab_size"])

    def step() -> None:
        model(input_ids=ids, labels=labels, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70)
    by_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70)
    Path(args.out).write_text(table + "\n\n" + by_cpu)
    print(table + "\n\n" + by_cpu)


if __name__ == "__main__":
    main()
