"""Weights are read from safetensors only; pickled PyTorch weights are refused with the way out.

A `pytorch_model.bin` or `adapter_model.bin` is a pickle: unpickling can run code hidden in the
file, and torch's restricted loader (`weights_only=True`) has had holes. Every place that loads a
model or an adapter calls `refuse_pickled(folder)` first (and passes `use_safetensors=True` to
Hugging Face), so no weights file reaches `torch.load` unless the user asks for it once, knowingly:

    python -m kestrel convert FOLDER     # convert(FOLDER): *.bin -> *.safetensors beside them

Light on purpose (torch is imported only by `convert`): the job preflight calls `refuse_pickled`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kestrel.errors import ModelLoadError

# Weight files Hugging Face and PEFT would unpickle; training_args.bin, optimizer.pt and the like
# are not weights and are never loaded as such.
_PICKLED = re.compile(r"^(pytorch_model(-\d+-of-\d+)?\.bin|adapter_model\.bin|consolidated(\.\d+)?\.pth|model\.pt)$")
_INDEX = "pytorch_model.bin.index.json"


def pickled_weights(folder: Path) -> list[Path]:
    """The pickled weight files in `folder` when it holds no safetensors weights ([] otherwise)."""
    try:
        names = sorted(p.name for p in folder.iterdir() if p.is_file())
    except OSError:
        return []
    if any(n.endswith(".safetensors") for n in names):
        return []  # Hugging Face and PEFT take the safetensors file and never open the pickle
    return [folder / n for n in names if _PICKLED.match(n)]


def refusal(folder: Path, files: list[Path]) -> str:
    """Why pickled weights are refused, and the command that converts them."""
    shown = ", ".join(p.name for p in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return (f"{folder} holds pickled PyTorch weights ({shown}) and no .safetensors file; Kestrel loads safetensors "
            "only, since unpickling a file can run code hidden in it. If you trust the file, convert it once with "
            f"`python -m kestrel convert {folder}` (it writes the .safetensors files beside it), then use the folder "
            "again.")


def refuse_pickled(folder: str | Path) -> None:
    """ModelLoadError when `folder` would be loaded from pickled weights."""
    folder = Path(folder).expanduser()
    found = pickled_weights(folder) if folder.is_dir() else []
    if found:
        raise ModelLoadError(refusal(folder, found))


def safetensors_name(name: str) -> str:
    """`pytorch_model-00001-of-00002.bin` -> `model-00001-of-00002.safetensors`, `adapter_model.bin`
    -> `adapter_model.safetensors`: the names Hugging Face and PEFT look for."""
    stem = name.rsplit(".", 1)[0]
    return stem.replace("pytorch_model", "model", 1) + ".safetensors"


def _plain_tensors(state: Any, source: Path) -> dict[str, Any]:
    """`state` as name -> contiguous tensor, no two sharing memory (safetensors refuses shared
    storage: tied embeddings are stored twice, as `save_pretrained` does)."""
    import torch

    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ModelLoadError(f"{source} is not a plain mapping of names to tensors, so it is not a weights file "
                             "Kestrel can convert; save the model with save_pretrained(..., safe_serialization=True)")
    out, seen = {}, set()
    for key, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        out[key] = tensor.clone().contiguous() if ptr in seen else tensor.contiguous()
        if ptr is not None:
            seen.add(ptr)
    return out


def convert(folder: str | Path) -> list[Path]:
    """Write a .safetensors file beside each pickled weights file of `folder` (and the shard index);
    returns the files written. Reads with torch's restricted loader (`weights_only=True`)."""
    import torch
    from safetensors.torch import save_file

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"{folder} is not a folder; give the model or adapter folder holding the .bin file")
    sources = [p for p in sorted(folder.iterdir()) if _PICKLED.match(p.name)]
    if not sources:
        raise ModelLoadError(f"{folder} holds no pickled weights (pytorch_model*.bin, adapter_model.bin) to convert")
    written = []
    for src in sources:
        try:
            state = torch.load(src, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is this file's problem
            # torch's own text is not shown: it suggests turning the restricted loader off.
            raise ModelLoadError(f"could not read {src} as plain tensors ({type(exc).__name__}): it holds more than "
                                 "weights, or is damaged; it is not converted") from None
        target = folder / safetensors_name(src.name)
        save_file(_plain_tensors(state, src), str(target), metadata={"format": "pt"})
        written.append(target)
    index = folder / _INDEX
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: safetensors_name(v) for k, v in data.get("weight_map", {}).items()}
        target = folder / "model.safetensors.index.json"
        target.write_text(json.dumps(data, indent=2))
        written.append(target)
    return written
