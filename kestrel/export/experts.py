"""Mixture-of-experts tensors for export: the checkpoint's expert layouts, PEFT's per-expert LoRA
merged in, and the stacked per-projection tensors llama.cpp reads.

Checkpoint layouts of an experts module `P` (`...mlp.experts`), as Hugging Face saves them:
- per expert (Qwen3-MoE, and Qwen3.5-MoE as transformers saves it): `P.{e}.gate_proj.weight` (I, H),
  `P.{e}.up_proj.weight`, `P.{e}.down_proj.weight` (H, I);
- fused, [gate | up] halves (the layout llama.cpp's converter reads for Qwen3.5-MoE): `P.gate_up_proj`
  (E, 2I, H), `P.down_proj` (E, H, I);
- fused, transposed (gpt-oss): `P.gate_up_proj` (E, H, 2I) with gate/up columns interleaved, `P.down_proj`
  (E, I, H), biases `P.gate_up_proj_bias` (E, 2I), `P.down_proj_bias` (E, H);
- MXFP4 (gpt-oss as released): `P.gate_up_proj_blocks` / `_scales` instead of `P.gate_up_proj`,
  dequantized here with transformers' own decoder (exact: e2m1 codes times a power of two).

PEFT's LoRA on the experts (`target_parameters`, `lora.ParamWrapper`) saves under `P.lora_A` (and
`P.base_layer.lora_A` for the second wrapped parameter): A (E r, in) with row e r + i, B (out, r E)
with column i E + e. Expert e's update, in (out, in) orientation: s * B[:, :, e] @ A[e]. Which
parameter a pair adapts follows from its input size: H for gate_up, I for down.

For GGUF, `GGUFView` presents llama.cpp's tensors: `P.gate_proj.weight` and `P.up_proj.weight`
(E, I, H), `P.down_proj.weight` (E, H, I), their biases, and gpt-oss's sinks as `sinks.weight`;
`gguf.TensorNameMap` names them ffn_gate_exps, ffn_up_exps, ffn_down_exps and attn_sinks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

from kestrel.model.registry import MoeSpec, family_for

_WRAPPED = re.compile(r"^(?P<prefix>.+\.experts)(?:\.base_layer)*$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_MX = ("_blocks", "_scales")


def moe_of(model_dir: Path) -> tuple[MoeSpec, Any] | None:
    """(the family's MoeSpec, its transformers config) for a mixture-of-experts checkpoint, else None."""
    spec = family_for(json.loads((model_dir / "config.json").read_text()))
    if spec is None or spec.moe is None:
        return None
    from transformers import AutoConfig  # its attribute maps: Qwen3-MoE saves num_local_experts

    return spec.moe, AutoConfig.from_pretrained(model_dir).get_text_config()  # an image-text model's experts are its LM's


class ExpertTensors:
    """A MoE checkpoint's expert tensors with PEFT's per-expert LoRA merged in.

    `pairs` are the adapter's expert pairs (`split_expert_pairs`); `scale(name)` the adapter's
    LoRA scale for a parameter name; `read(name)` reads a checkpoint tensor in fp32."""

    def __init__(self, moe: MoeSpec, config: Any, checkpoint_names: list[str],
                 pairs: dict[str, dict[str, torch.Tensor]], scale: Callable[[str], float]) -> None:
        self.moe, self.hidden = moe, int(config.hidden_size)
        self.num_experts = int(getattr(config, moe.num_experts_attr))
        self.deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}  # "P.gate_up_proj" -> (A3, B3, s)
        for module, pair in pairs.items():
            prefix = _WRAPPED.match(module).group("prefix")  # type: ignore[union-attr]
            a, b = pair["A"], pair["B"]
            param = "gate_up_proj" if a.shape[1] == self.hidden else "down_proj"
            a3 = a.reshape(self.num_experts, -1, a.shape[1])  # (E, r, in)
            b3 = b.reshape(b.shape[0], -1, self.num_experts)  # (out, r, E)
            self.deltas[f"{prefix}.{param}"] = (a3, b3, scale(f"{prefix}.{param}"))
        self.mxfp4 = {n[: -len(_MX[0])] for n in checkpoint_names if n.endswith(_MX[0])}

    def names(self, checkpoint_names: list[str]) -> list[str]:
        """The checkpoint's names with each MXFP4 pair shown as its 16-bit tensor."""
        out = []
        for name in checkpoint_names:
            if name.endswith(_MX[0]):
                out.append(name[: -len(_MX[0])])
            elif not name.endswith(_MX[1]):
                out.append(name)
        return out

    def touched(self) -> set[str]:
        """The fused parameter names the adapter changes (`P.gate_up_proj`, `P.down_proj`)."""
        return set(self.deltas)

    def shape(self, name: str, stored: Callable[[str], tuple[int, ...]]) -> tuple[int, ...]:
        if name in self.mxfp4:  # blocks (E, out, in/32, 16) -> (E, in, out)
            e, out, groups, half = stored(name + _MX[0])
            return (e, groups * half * 2, out)
        return stored(name)

    def read(self, name: str, raw: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The stored tensor (MXFP4 dequantized) in fp32."""
        if name in self.mxfp4:
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors

            return convert_moe_packed_tensors(raw(name + _MX[0]), raw(name + _MX[1]), dtype=torch.float32)
        return raw(name).float()

    def _delta(self, key: str, device: torch.device) -> torch.Tensor | None:
        """Every expert's update of `key` (E, out, in), fp32."""
        if key not in self.deltas:
            return None
        a3, b3, s = self.deltas[key]
        return s * torch.einsum("ore,eri->eoi", b3.to(device).float(), a3.to(device).float())

    def merge(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (fp32, as stored) with the adapter's expert update merged in."""
        per_expert = _PER_EXPERT.match(name)
        if per_expert:
            prefix, e, proj = per_expert.group("prefix"), int(per_expert.group("e")), per_expert.group("proj")
            delta = self._delta(f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}", tensor.device)
            if delta is None:
                return tensor
            rows = tensor.shape[0]
            if proj == "gate_proj":
                return tensor + delta[e, :rows]  # [gate | up] halves of the fused update
            return tensor + (delta[e, rows:] if proj == "up_proj" else delta[e])
        delta = self._delta(name, tensor.device)
        if delta is None:
            return tensor
        return tensor + (delta.transpose(1, 2) if self.moe.transposed else delta)


def split_expert_pairs(pairs: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """Take PEFT's expert pairs (modules `...experts`, `...experts.base_layer`) out of `pairs`."""
    found = {m: pairs.pop(m) for m in [m for m in pairs if _WRAPPED.match(m)]}
    return found


class GGUFView:
    """`tensors` (a `ModelTensors` of a MoE checkpoint) as llama.cpp's stacked expert tensors;
    shapes come from the checkpoint's headers, data is read tensor by tensor in `get`."""

    def __init__(self, tensors: Any, moe: MoeSpec) -> None:
        self.tensors, self.moe, self.lora = tensors, moe, tensors.lora
        self._plan: dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]] = {}
        grouped: dict[str, list[str]] = {}
        for name in tensors.names():
            per_expert = _PER_EXPERT.match(name)
            prefix = name.rsplit(".", 1)[0]
            if per_expert:
                grouped.setdefault(f"{per_expert.group('prefix')}.{per_expert.group('proj')}.weight", []).append(name)
            elif name.endswith(".experts.gate_up_proj") or name.endswith(".experts.gate_up_proj_bias"):
                suffix = ".bias" if name.endswith("_bias") else ".weight"
                shape = self._half_shape(name)
                self._plan[f"{prefix}.gate_proj{suffix}"] = (shape, lambda n=name: self._half(n, 0))
                self._plan[f"{prefix}.up_proj{suffix}"] = (shape, lambda n=name: self._half(n, 1))
            elif name.endswith(".experts.down_proj"):
                e, a, b = tensors.shape(name)
                shape = (e, b, a) if moe.transposed else (e, a, b)
                self._plan[f"{name}.weight"] = (shape, lambda n=name: self._down(n))
            elif name.endswith(".experts.down_proj_bias"):
                self._plan[f"{prefix}.down_proj.bias"] = (tensors.shape(name), lambda n=name: tensors.get(n))
            elif name.endswith(".self_attn.sinks"):
                self._plan[f"{name}.weight"] = (tensors.shape(name), lambda n=name: tensors.get(n))
            else:
                self._plan[name] = (tensors.shape(name), lambda n=name: tensors.get(n))
        for virtual, parts in grouped.items():
            parts.sort(key=lambda n: int(_PER_EXPERT.match(n).group("e")))  # type: ignore[union-attr]
            shape = (len(parts), *tensors.shape(parts[0]))
            self._plan[virtual] = (shape, lambda ps=tuple(parts): torch.stack([tensors.get(p) for p in ps]))

    def _half_shape(self, name: str) -> tuple[int, ...]:
        shape = self.tensors.shape(name)
        if len(shape) == 2:  # bias (E, 2I)
            return (shape[0], shape[1] // 2)
        e, a, b = shape
        return (e, b // 2, a) if self.moe.transposed else (e, a // 2, b)

    def _half(self, name: str, which: int) -> torch.Tensor:
        """Gate (0) or up (1) of a fused gate_up weight (-> (E, I, H)) or bias (-> (E, I))."""
        w = self.tensors.get(name)
        if w.dim() == 3 and self.moe.transposed:
            w = w.transpose(1, 2)  # (E, 2I, H)
        if self.moe.activation == "gpt_oss":  # gate/up interleaved
            return w[:, which::2].contiguous()
        half = w.shape[1] // 2
        return w[:, which * half:(which + 1) * half].contiguous()

    def _down(self, name: str) -> torch.Tensor:
        w = self.tensors.get(name)
        return w.transpose(1, 2).contiguous() if self.moe.transposed else w

    def names(self) -> list[str]:
        return list(self._plan)

    def language_names(self) -> list[str]:
        """The language model's tensors (all of them for a text-only checkpoint)."""
        from kestrel.model.multimodal import is_language_tensor

        return [n for n in self._plan if not self.tensors.image_text or is_language_tensor(n)]

    def canonical(self, name: str) -> str:
        return self.tensors.canonical(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._plan[name][0]

    def get(self, name: str) -> torch.Tensor:
        return self._plan[name][1]()
