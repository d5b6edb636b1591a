"""Model tensors read one at a time, with a LoRA adapter merged in, and the merged 16-bit model
written as sharded safetensors without ever holding the whole model.

    tensors = ModelTensors(src.model_dir, src.adapter_dir)
    w = tensors.get("model.layers.0.self_attn.q_proj.weight")   # (out, in), fp32, adapter merged
    write_safetensors_shards(tensors, out_dir, torch.bfloat16)

Merge math (PEFT's LoRA): W' = W + s * B @ A, with A (r, in), B (out, r) and s = alpha / r
(alpha / sqrt(r) for rsLoRA; per-module rank and alpha from rank_pattern / alpha_pattern). An
embedding's adapter is stored transposed: W' = W + s * (B @ A).T with A (r, vocab), B (dim, r).
Sums are done in fp32 and cast once.

A base checkpoint stored 4-bit by bitsandbytes (a pre-quantized QLoRA base, such as
`*-bnb-4bit`) is dequantized (NF4/FP4 codes times block absmax) before the merge: the result is
as close to the original weights as the 4-bit codes allow, and `ModelTensors.dequantized` says
so. Peak memory is one tensor (plus the adapter, a few hundred MB at most).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from kestrel.errors import KestrelError
from kestrel.export.experts import ExpertTensors, moe_of, split_expert_pairs

_BNB_SUFFIXES = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".quant_state.bitsandbytes__nf4",
                 ".quant_state.bitsandbytes__fp4", ".SCB", ".weight_format")
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8, "I8": torch.int8}
_SAFETENSORS_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


class CheckpointTensors:
    """The tensors of a safetensors checkpoint (one file or shards), by Hugging Face name."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._file_of: dict[str, Path] = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(path, "pt") as f:
                for key in f.keys():
                    self._file_of[key] = path
        self._handles: dict[Path, Any] = {}
        self.quantized = any(k.endswith(".quant_map") or k.endswith(".SCB") for k in self._file_of)
        if any(k.endswith(".SCB") for k in self._file_of):
            raise KestrelError(f"{folder} is stored 8-bit (bitsandbytes LLM.int8); export needs 16-bit or 4-bit weights")

    def _handle(self, key: str) -> Any:
        path = self._file_of[key]
        if path not in self._handles:
            self._handles[path] = safe_open(path, "pt")
        return self._handles[path]

    def raw(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def names(self) -> list[str]:
        return [k for k in self._file_of if not any(s in k for s in _BNB_SUFFIXES)]

    def _quant_state_key(self, name: str) -> str | None:
        for suffix in (".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4"):
            if name + suffix in self._file_of:
                return name + suffix
        return None

    def shape(self, name: str) -> tuple[int, ...]:
        qs_key = self._quant_state_key(name)
        if qs_key is not None:
            return tuple(json.loads(bytes(self.raw(qs_key).tolist()))["shape"])
        return tuple(self._handle(name).get_slice(name).get_shape())

    def stored_dtype(self, name: str) -> torch.dtype:
        if self._quant_state_key(name) is not None:
            return torch.bfloat16  # what a 4-bit weight dequantizes to
        return _DTYPES.get(self._handle(name).get_slice(name).get_dtype(), torch.float32)

    def get(self, name: str) -> torch.Tensor:
        """The tensor in its stored dtype; a 4-bit one dequantized to bf16."""
        qs_key = self._quant_state_key(name)
        if qs_key is None:
            return self.raw(name)
        import bitsandbytes.functional as bnbf

        prefix = name + "."
        state = {k[len(prefix):]: self.raw(k) for k in self._file_of if k.startswith(prefix)}
        quant_state = bnbf.QuantState.from_dict(state, device=torch.device("cpu"))
        return bnbf.dequantize_4bit(self.raw(name), quant_state).to(torch.bfloat16)


def _pattern_value(module: str, patterns: dict[str, Any], default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches the end of the module name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


class LoraDeltas:
    """A PEFT LoRA adapter, held in memory (it is small), as deltas by base tensor name."""

    def __init__(self, adapter_dir: Path, rename: Callable[[str], str] = lambda name: name) -> None:
        self.rename = rename  # module names onto the names ModelTensors compares (see there)
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
        if cfg.get("peft_type", "LORA") != "LORA":
            raise KestrelError(f"{adapter_dir} is a {cfg.get('peft_type')} adapter; export merges LoRA adapters only")
        if cfg.get("use_dora"):
            raise KestrelError(f"{adapter_dir} is a DoRA adapter; export merges plain LoRA adapters only")
        if cfg.get("fan_in_fan_out"):
            raise KestrelError(f"{adapter_dir}: fan_in_fan_out adapters (Conv1D layers) are not supported")
        self.config = cfg
        self.pairs: dict[str, dict[str, torch.Tensor]] = {}  # module -> {"A": .., "B": .., "bias": ..}
        self.replaced: dict[str, torch.Tensor] = {}  # full tensors saved with the adapter (modules_to_save)
        with safe_open(adapter_dir / "adapter_model.safetensors", "pt") as f:
            for key in f.keys():
                self._add(key, f.get_tensor(key))
        self.expert_pairs = split_expert_pairs(self.pairs)  # per-expert LoRA (`kestrel.export.experts`)

    def _add(self, key: str, tensor: torch.Tensor) -> None:
        name = self.rename(key.removeprefix("base_model.model."))
        for tag, part in ((".lora_A.weight", "A"), (".lora_B.weight", "B"), (".lora_B.bias", "bias"),
                          (".lora_embedding_A", "embA"), (".lora_embedding_B", "embB")):
            if name.endswith(tag):
                self.pairs.setdefault(name[: -len(tag)], {})[part] = tensor
                return
        if "lora_magnitude_vector" in name:
            raise KestrelError("DoRA adapters are not supported by export")
        # modules_to_save and saved embedding layers: whole tensors that replace the base ones
        self.replaced[name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")] = tensor

    def scale(self, module: str) -> float:
        r = _pattern_value(module, self.config.get("rank_pattern") or {}, self.config["r"])
        alpha = _pattern_value(module, self.config.get("alpha_pattern") or {}, self.config["lora_alpha"])
        return alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r

    def touched(self) -> set[str]:
        """Base tensor names the adapter changes."""
        names = {f"{m}.weight" for m in self.pairs} | set(self.replaced)
        return names | {f"{m}.bias" for m, p in self.pairs.items() if "bias" in p}

    def delta_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of B @ A (or its transpose for embeddings) by base weight name."""
        shapes = {}
        for module, pair in self.pairs.items():
            if "A" in pair and "B" in pair:
                shapes[f"{module}.weight"] = (pair["B"].shape[0], pair["A"].shape[1])
            elif "embA" in pair and "embB" in pair:
                shapes[f"{module}.weight"] = (pair["embA"].shape[1], pair["embB"].shape[0])
            else:
                raise KestrelError(f"the adapter's {module} has only one of lora_A / lora_B: the file is incomplete")
        return shapes

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (fp32) with this adapter merged in; the tensor itself when untouched."""
        if name in self.replaced:
            tensor = self.replaced[name].to(tensor.device, torch.float32)
        module, _, leaf = name.rpartition(".")
        pair = self.pairs.get(module)
        if pair is None:
            return tensor
        s = self.scale(module)
        part = {k: v.to(tensor.device, torch.float32) for k, v in pair.items()}
        if leaf == "weight" and "A" in part:
            tensor = tensor + s * (part["B"] @ part["A"])  # (out, r) @ (r, in)
        elif leaf == "weight" and "embA" in part:
            tensor = tensor + s * (part["embB"] @ part["embA"]).T  # ((dim, r) @ (r, vocab)).T
        elif leaf == "bias" and "bias" in part:
            tensor = tensor + s * part["bias"]
        return tensor


class ModelTensors:
    """The tensors to export: base checkpoint tensors with the adapter (if any) merged in.

    `image_text`: the checkpoint is an image-text model, whose language model's tensors HF saves
    under another prefix than its modules carry at run time (Gemma 3: `language_model.model.*`
    saved, `model.language_model.*` in the adapter); both sides are compared under
    `kestrel.model.multimodal.causal_lm_name`, and `language_names()` lists the language model's."""

    def __init__(self, model_dir: Path, adapter_dir: Path | None = None, device: str | torch.device | None = None,
                 image_text: bool = False) -> None:
        from kestrel.model.multimodal import causal_lm_name

        self.device = torch.device(device or "cpu")  # where merges and casts run; results stay there
        self.image_text = image_text
        self.canonical: Callable[[str], str] = causal_lm_name if image_text else (lambda name: name)
        self.checkpoint = CheckpointTensors(model_dir)
        self.lora = LoraDeltas(adapter_dir, self.canonical) if adapter_dir is not None else None
        self.dequantized = self.checkpoint.quantized
        names = self.checkpoint.names()
        self.experts = _experts(model_dir, names, self.lora)
        if self.experts is not None:
            self.dequantized = self.dequantized or bool(self.experts.mxfp4)
            names = self.experts.names(names)
        stored = {self.canonical(n): n for n in names}
        if self.lora is not None:
            missing = sorted(self.lora.touched() - set(stored) - set(self.lora.replaced))
            if self.experts is None and self.lora.expert_pairs:
                missing = sorted(self.lora.expert_pairs) + missing
            elif self.experts is not None:
                fused = {m.group(1) for m in map(_PER_EXPERT_NAME.match, stored) if m}
                missing += sorted(k for k in self.experts.touched() if k not in stored and k.rsplit(".", 1)[0] not in fused)
            if missing:
                raise KestrelError(
                    f"the adapter changes {missing[0]} (and {len(missing) - 1} more), which the base model "
                    f"{model_dir} does not have: the adapter was trained on another model"
                )
            names += [n for n in self.lora.replaced if n not in stored]
            for name, shape in self.lora.delta_shapes().items():
                if tuple(shape) != self.checkpoint.shape(stored[name]):
                    raise KestrelError(
                        f"the adapter's {name} is {tuple(shape)} but the base model {model_dir} has "
                        f"{self.checkpoint.shape(stored[name])}: the adapter was trained on another model"
                    )
        self._names = [n for n in names if not n.endswith("rotary_emb.inv_freq")]

    def names(self) -> list[str]:
        return list(self._names)

    def language_names(self) -> list[str]:
        """The language model's tensors (all of them for a text-only model)."""
        from kestrel.model.multimodal import is_language_tensor

        return [n for n in self._names if not self.image_text or is_language_tensor(n)]

    def shape(self, name: str) -> tuple[int, ...]:
        if self.lora is not None and name in self.lora.replaced:
            return tuple(self.lora.replaced[name].shape)
        if self.experts is not None:
            return self.experts.shape(name, self.checkpoint.shape)
        return self.checkpoint.shape(name)

    def stored_dtype(self, name: str) -> torch.dtype:
        if self.lora is not None and name in self.lora.replaced:
            return self.lora.replaced[name].dtype
        if self.experts is not None and name in self.experts.mxfp4:
            return torch.bfloat16  # what MXFP4 dequantizes to
        return self.checkpoint.stored_dtype(name)

    def base_names(self) -> list[str]:
        """The base checkpoint's tensor names (an MXFP4 pair named as its 16-bit tensor)."""
        names = self.checkpoint.names()
        return self.experts.names(names) if self.experts is not None else names

    def base(self, name: str) -> torch.Tensor:
        """A base tensor dequantized (4-bit, MXFP4), adapter not merged, fp32 on the CPU."""
        if self.experts is not None:
            return self.experts.read(name, self.checkpoint.get)
        return self.checkpoint.get(name).float()

    def get(self, name: str) -> torch.Tensor:
        """The tensor in fp32 on `self.device`, adapter merged."""
        if self.lora is not None and name in self.lora.replaced:
            return self.lora.apply(name, self.lora.replaced[name].to(self.device, torch.float32))
        if self.experts is not None:
            tensor = self.experts.read(name, self.checkpoint.get).to(self.device)
            tensor = self.experts.merge(name, tensor)
        else:
            tensor = self.checkpoint.get(name).to(self.device).float()
        return self.lora.apply(self.canonical(name), tensor) if self.lora is not None else tensor

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of all tensors at `dtype` (default: as stored)."""
        total = 0
        for name in self._names:
            size = (dtype or self.stored_dtype(name)).itemsize
            total += math.prod(self.shape(name)) * size
        return total


_PER_EXPERT_NAME = re.compile(r"^(.+\.experts)\.\d+\.(?:gate_proj|up_proj|down_proj)\.weight$")


def _experts(model_dir: Path, names: list[str], lora: LoraDeltas | None) -> ExpertTensors | None:
    """The expert view of a mixture-of-experts checkpoint (None for a dense one)."""
    found = moe_of(model_dir) if (model_dir / "config.json").is_file() else None
    if found is None:
        return None
    pairs = lora.expert_pairs if lora is not None else {}
    return ExpertTensors(found[0], found[1], names, pairs, lora.scale if lora is not None else lambda n: 1.0)


def _shards(tensors: ModelTensors, dtype: torch.dtype, max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in tensors.names():
        nbytes = math.prod(tensors.shape(name)) * dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_shard(path: Path, names: list[str], tensors: ModelTensors, dtype: torch.dtype,
                 on_tensor: Callable[[str], None]) -> int:
    """One safetensors file written header first, then tensor by tensor: one tensor in memory."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        nbytes = math.prod(tensors.shape(name)) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(tensors.shape(name)),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data must start 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in names:
            data = tensors.get(name).to(dtype).cpu().contiguous()
            f.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
            on_tensor(name)
    return offset


def write_safetensors_shards(tensors: ModelTensors, out_dir: Path, dtype: torch.dtype,
                             max_shard_bytes: int = 5 * 2**30,
                             on_tensor: Callable[[str], None] = lambda name: None) -> list[Path]:
    """Write every tensor at `dtype` as model.safetensors or model-0000i-of-0000n.safetensors + index."""
    shards = _shards(tensors, dtype, max_shard_bytes)
    n = len(shards)
    paths = [out_dir / ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)]
    weight_map, total = {}, 0
    for path, names in zip(paths, shards):
        total += _write_shard(path, names, tensors, dtype, on_tensor)
        weight_map.update({name: path.name for name in names})
    if n > 1:
        index = out_dir / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        paths.append(index)
    return paths
