"""Checkpoints too large to write in bf16 for a benchmark (issue 28's 70B QLoRA across GPUs).

The Llama-3.1-70B shape is 141 GB in bf16: writing it, then having every rank read and quantize
it, would take most of a device call. A random model's decoder layers are interchangeable for
speed and memory, so `build_nf4_model_dir` builds `LAYERS_BUILT` layers in bf16 at the real
widths, has transformers + bitsandbytes quantize them to NF4 on the GPU and save them in
bitsandbytes' serialized 4-bit layout (which `from_pretrained` loads as it is), and then writes
those tensors again under the names of every layer of the real depth (`write_replicated`): about
40 GB of NF4 weights and bf16 embeddings for the 70B shape (`_nf4_bytes`), with no 141 GB bf16
folder ever written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable

from bench.matrix_models import MODEL_ROOT, check_free_disk, model_dir, write_model_dir
from bench.model_shapes import ARCHITECTURES, LARGE_MODELS

LAYERS_BUILT = 2  # decoder layers built and quantized; the rest are copies of them
SHARD_BYTES = 4 * 2**30  # at most this much a safetensors file (one tensor larger gets its own)
INDEX = "model.safetensors.index.json"
_LAYER = re.compile(r"^(.*\blayers\.)(\d+)(\..+)$")


def large_config(name: str, layers: int | None = None) -> Any:
    """LARGE_MODELS[name] as a transformers config (`layers` decoder layers when given)."""
    from transformers import AutoConfig

    kwargs = dict(LARGE_MODELS[name])
    model_type = kwargs.pop("model_type")
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    cfg = AutoConfig.for_model(model_type, **kwargs)
    cfg.architectures = [ARCHITECTURES[model_type]]
    return cfg


def replicated_names(keys: Iterable[str], built: int, total: int) -> dict[str, str]:
    """Target tensor name -> source name: a key outside the decoder layers as it is, and layer i's
    keys (`...layers.i.rest`) from layer i % built. Raises when the source's layers are not 0..built-1."""
    keys = list(keys)
    seen = {int(m.group(2)) for k in keys if (m := _LAYER.match(k))}
    if seen != set(range(built)):
        raise ValueError(f"the source checkpoint's layers are {sorted(seen)}, expected 0..{built - 1}")
    names: dict[str, str] = {}
    for key in keys:
        m = _LAYER.match(key)
        if m is None:
            names[key] = key
            continue
        if int(m.group(2)) >= built:
            continue
        for i in range(int(m.group(2)), total, built):
            names[f"{m.group(1)}{i}{m.group(3)}"] = key
    return names


def _layer_order(name: str) -> tuple[int, str]:
    m = _LAYER.match(name)
    return (int(m.group(2)) if m else -1, name)


def write_replicated(source: Path, target: Path, total: int) -> Path:
    """`source` (a saved checkpoint whose decoder has layers 0..B-1) written to `target` with `total`
    layers, layer i a copy of layer i % B, in shards of at most SHARD_BYTES with their index;
    config.json gets `num_hidden_layers = total`; the other files (tokenizer) are copied."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            tensors.update({k: handle.get_tensor(k) for k in handle.keys()})
    config = json.loads((source / "config.json").read_text())
    names = replicated_names(tensors, config["num_hidden_layers"], total)
    target.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(names, key=_layer_order):
        nbytes = tensors[names[name]].numel() * tensors[names[name]].element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total_size = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        part = {name: tensors[names[name]].clone() for name in shard}  # a file holds no shared storage
        save_file(part, str(target / file), metadata={"format": "pt"})
        total_size += sum(t.numel() * t.element_size() for t in part.values())
        weight_map.update(dict.fromkeys(shard, file))
    (target / INDEX).write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=1))
    config["num_hidden_layers"] = total
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [config["layer_types"][i % len(config["layer_types"])] for i in range(total)]
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for extra in source.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", INDEX):
            shutil.copy2(extra, target / extra.name)
    return target


def _quantize_folder(bf16: Path, target: Path) -> None:
    """`bf16`'s checkpoint loaded onto GPU 0 in NF4 (double quantization, bf16 compute, as Kestrel's
    QLoRA loads) and saved in bitsandbytes' serialized 4-bit layout at `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(bf16, quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map={"": 0})
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(bf16).save_pretrained(target)
    del model
    torch.cuda.empty_cache()


def build_nf4_model_dir(name: str, root: Path = MODEL_ROOT) -> Path:
    """LARGE_MODELS[name] as an NF4 checkpoint at `root/name` (built once; see the module's docstring).
    Needs a CUDA GPU (bitsandbytes quantizes there); refuses up front when the disk is short."""
    folder = model_dir(name, root)
    if (folder / "config.json").exists():
        return folder
    cfg = large_config(name)
    nf4_bytes = _nf4_bytes(cfg)
    check_free_disk(folder, nf4_bytes + _nf4_bytes(large_config(name, LAYERS_BUILT)) * 3, name)
    work = folder.with_name(folder.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    bf16 = write_model_dir(large_config(name, LAYERS_BUILT), work / "bf16", "cuda", name)
    _quantize_folder(bf16, work / "nf4")
    shutil.rmtree(bf16)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_replicated(work / "nf4", tmp, cfg.num_hidden_layers)
    shutil.rmtree(work)
    os.replace(tmp, folder)
    return folder


def _nf4_bytes(cfg: Any) -> int:
    """Bytes of `cfg`'s checkpoint with its decoder linears in NF4 (half a byte a weight plus the
    block scales, about 0.53 bytes in all) and the rest (embeddings, head, norms) in bf16."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * getattr(cfg, "head_dim", h // cfg.num_attention_heads)
    q = cfg.num_attention_heads * getattr(cfg, "head_dim", h // cfg.num_attention_heads)
    linear = layers * (h * q * 2 + h * kv * 2 + 3 * h * i)
    rest = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + layers * 2 * h
    return int(linear * 0.53) + rest * 2
