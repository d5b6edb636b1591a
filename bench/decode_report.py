"""The decode benchmark's summary: the ratios its targets are stated in and a markdown table."""

from __future__ import annotations

import json
import math
from typing import Any


def summarize(report: dict) -> None:
    """Ratios the targets are stated in, and a markdown table for bench/RESULTS.md."""
    rows = {(r["name"], r["batch"]): r for r in report["results"] if "error" not in r}
    bound = report["bound_tokens_per_s_b1"]
    ratios: dict[str, Any] = {}
    if ("kestrel", 1) in rows:
        k1 = rows[("kestrel", 1)]["tokens_per_s"]
        ratios["kestrel_b1_of_bound"] = k1 / bound
        ratios["kestrel_b1_decode_of_bound"] = rows[("kestrel", 1)]["decode_tokens_per_s"] / bound
        for other in ("hf_dynamic", "hf_static_compile", "unsloth_inference", "kestrel_cublas", "kestrel_separate",
                      "kestrel_no_pdl", "kestrel_lora_r16", "kestrel_lora_r16_separate", "kestrel_nf4"):
            if (other, 1) in rows:
                ratios[f"{other}_b1_over_kestrel"] = rows[(other, 1)]["tokens_per_s"] / k1
        if ("hf_dynamic", 1) in rows:
            same = rows[("kestrel", 1)]["tokens_row0"] == rows[("hf_dynamic", 1)]["tokens_row0"]
            ratios["kestrel_matches_hf_first_32_tokens"] = same
        if ("kestrel_lora_r16", 1) in rows:  # the adapter target is stated on decode speed
            ratios["lora_b1_decode_over_kestrel_decode"] = (
                rows[("kestrel_lora_r16", 1)]["decode_tokens_per_s"] / rows[("kestrel", 1)]["decode_tokens_per_s"])
    if ("kestrel_lora_r16_separate", 1) in rows and ("kestrel_separate", 1) in rows:
        ratios["lora_separate_over_base_separate_b1"] = (
            rows[("kestrel_lora_r16_separate", 1)]["tokens_per_s"] / rows[("kestrel_separate", 1)]["tokens_per_s"])
    batch = max((b for _, b in rows), default=1)
    for other in ("hf_dynamic", "unsloth_inference"):
        if ("kestrel", batch) in rows and (other, batch) in rows:
            ours, theirs = rows[("kestrel", batch)]["tokens_per_s"], rows[(other, batch)]["tokens_per_s"]
            ratios[f"kestrel_b{batch}_over_{other}"] = ours / theirs
    report["ratios"] = ratios
    report["table"] = table(report["results"], bound)
    print(report["table"])
    print(json.dumps(ratios, indent=1))


def table(results: list[dict], bound: float) -> str:
    """A markdown table of the rows (errors included), for bench/RESULTS.md."""
    lines = ["| variant | batch | first token ms | tokens/s | decode tokens/s | of bound (b1) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            error = " ".join(str(r["error"]).split())[-80:]  # one line: the end says most
            lines.append(f"| {r['name']} | {r['batch']} | error: {error} | | | |")
            continue
        frac = f"{r['tokens_per_s'] / bound:.0%}" if r["batch"] == 1 and math.isfinite(bound) else ""
        lines.append(f"| {r['name']} | {r['batch']} | {r['first_token_ms']:.1f} | {r['tokens_per_s']:.1f} | "
                     f"{r['decode_tokens_per_s']:.1f} | {frac} |")
    return "\n".join(lines)
