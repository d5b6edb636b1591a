"""Loading a model and its tokenizer: a hub id, a local folder, or the built-in `demo` model.

    model, tokenizer = load("demo", max_seq_length=1024)
    model, tokenizer = load("/models/llama-3.1-8b", 4096, load_in_4bit=True)

The model comes back patched onto Kestrel's fast paths (`kestrel.model.patching`) when its family is
registered; an unknown family loads unpatched with a one-line notice. An image-text checkpoint
(Gemma 3 4B+, Gemma 4, Qwen3.5, Mistral 3) loads whole, its vision tower frozen: training on text
changes only its language model (`kestrel.model.multimodal`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase,
)

from kestrel.constants import DEMO
from kestrel.errors import ModelLoadError
from kestrel.paths import ASSETS, models_dir
from kestrel.model.multimodal import freeze_outside_language_model, is_image_text
from kestrel.model.expert_quant import quantize_experts
from kestrel.model.patching import PatchFlags, PatchHandle, patch_model
from kestrel.model.registry import family_for, hf_attention
from kestrel.model.safe_weights import refuse_pickled

log = logging.getLogger("kestrel")

DEMO_ASSETS = ASSETS / "demo"
CHATML_TEMPLATE = (DEMO_ASSETS / "chat_template.jinja").read_text()


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto` -> bf16 on a GPU that supports it, fp16 on older GPUs, fp32 on a CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    named = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype in named:
        return named[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def demo_model_dir() -> Path:
    """The built-in demo model: config and tokenizer from assets/, weights made once, seeded."""
    target = models_dir() / DEMO
    if (target / "model.safetensors").exists():
        return target
    config = AutoConfig.from_pretrained(DEMO_ASSETS)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_ASSETS)
    # Written to a temporary folder and renamed, so two processes creating it never see half a model.
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=models_dir()))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(model: str) -> str:
    """A local folder (checked for config.json), `demo`, or a hub id passed through unchanged."""
    if model == DEMO:
        return str(demo_model_dir())
    path = Path(model).expanduser()
    looks_local = path.is_absolute() or model.startswith((".", "~")) or path.exists()
    if looks_local:
        if not path.is_dir():
            raise ModelLoadError(f"model folder {path} does not exist")
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"model folder {path} has no config.json: point `model` at a Hugging Face model folder "
                "(the one holding config.json and *.safetensors)"
            )
        return str(path)
    return model


def load_tokenizer(path: str, max_seq_length: int) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE  # ChatML when the model ships none
    tokenizer.model_max_length = max_seq_length
    return tokenizer


def _quantization_config(compute_dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def _family_kwargs(path: str, kwargs: dict, load_in_4bit: bool) -> None:
    """What a family's checkpoint needs on top of `kwargs` (changed in place).

    gpt-oss: HF runs its attention sinks only in eager, flash or flex attention, not SDPA. Its
    checkpoints ship the experts in MXFP4; they are dequantized to 16-bit on load. MXFP4 compute in
    transformers is inference-only (the `kernels` hub's triton_kernels, not installed here, and no
    backward), while LoRA on the experts needs a differentiable expert product; gpt-oss-20b in
    bf16 (about 42 GB) trains with LoRA on one 80 GB GPU. Under 4-bit loading the dequantized
    experts go to NF4 after load (`_quantize_experts`), while its attention linears stay 16-bit:
    one `from_pretrained` takes one quantization config, and MXFP4's dequantization is it."""
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return  # from_pretrained below reports it
    kwargs["attn_implementation"] = hf_attention(config, kwargs["attn_implementation"])
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if str(method) in ("mxfp4", "QuantizationMethod.MXFP4"):
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)  # in place of bitsandbytes' under 4-bit
        log.info("%s: MXFP4 experts dequantized to %s%s", path, kwargs.get("dtype"),
                 "; its attention linears stay 16-bit under 4-bit loading (no bitsandbytes with MXFP4)" if load_in_4bit else "")


def _match_expert_dtype(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """HF dequantizes MXFP4 experts to bf16 whatever dtype was asked for: bring them to it."""
    for name, param in model.named_parameters():
        if ".experts." in name and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def load(
    model: str,
    max_seq_length: int = 2048,
    load_in_4bit: bool = False,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
    patch: bool | PatchFlags = True,
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `model` (hub id, local folder or `demo`) and its tokenizer, patched for speed.

    `load_in_4bit` quantizes the weights to NF4 with double quantization and bf16 compute
    (QLoRA), a mixture of experts' expert weights too when patched; it needs CUDA. `patch=False`
    returns the plain Hugging Face model.
    """
    dev = torch.device(device) if device is not None else default_device()
    if load_in_4bit and dev.type != "cuda":
        raise ModelLoadError(
            "4-bit loading (QLoRA) needs an NVIDIA GPU with CUDA, and none was found. "
            "Train in 16-bit instead: set `method: lora` (or `full`)."
        )
    path = resolve_model_path(model)
    refuse_pickled(path)  # a hub id is no folder: use_safetensors below refuses its pickles
    compute_dtype = resolve_dtype(dtype, dev)
    kwargs: dict = {"dtype": compute_dtype, "attn_implementation": attn_implementation, "use_safetensors": True}
    if load_in_4bit:
        kwargs["quantization_config"] = _quantization_config(compute_dtype)
        kwargs["device_map"] = {"": dev.index or 0}
    _family_kwargs(path, kwargs, load_in_4bit)
    try:
        tokenizer = load_tokenizer(path, max_seq_length)
        auto = AutoModelForImageTextToText if is_image_text(AutoConfig.from_pretrained(path)) else AutoModelForCausalLM
        hf_model = auto.from_pretrained(path, **kwargs)
    except OSError as exc:
        if Path(path).exists():
            raise ModelLoadError(f"could not load model from {path}: {exc}") from exc
        if ".safetensors" in str(exc):  # the hub repo has pickled weights only
            raise ModelLoadError(
                f"model {model!r} has no safetensors weights on the Hugging Face hub, and Kestrel does not load "
                "pickled ones (unpickling can run code). Download it to a folder, convert it with "
                "`python -m kestrel convert FOLDER` if you trust it, and point `model` at that folder.") from exc
        raise ModelLoadError(
            f"could not find model {model!r}: it is not a local folder, and downloading it from the "
            "Hugging Face hub failed (offline, a typo, or a gated model). Pick a local folder, "
            f"or `demo` for the built-in model. ({exc.__class__.__name__})"
        ) from exc
    if not load_in_4bit:
        hf_model.to(dev)
    _match_expert_dtype(hf_model, compute_dtype)
    hf_model.config.use_cache = False
    hf_model.kestrel_max_seq_length = max_seq_length
    frozen = freeze_outside_language_model(hf_model)
    if frozen:
        log.info("%s is an image-text model: its language model trains on text, %d vision/projector "
                 "parameters stay frozen", type(hf_model).__name__, frozen)
    handle = patch_model(hf_model, patch if isinstance(patch, PatchFlags) else PatchFlags()) if patch else None
    if load_in_4bit:
        _quantize_experts(hf_model, path, handle)
    return hf_model, tokenizer


def _quantize_experts(model: PreTrainedModel, path: str, handle: PatchHandle | None) -> None:
    """QLoRA on a mixture of experts: bitsandbytes quantized the linears (attention, a shared
    expert); the experts' 3-D weights came in 16-bit and go to NF4 here, one layer at a time
    (`kestrel.model.expert_quant`). Only the patched MoE block reads NF4 experts, so an unpatched
    model keeps them 16-bit."""
    spec = family_for(model.config)
    if spec is None or spec.moe is None:
        return
    if handle is None or not handle.flags.mlp or "mlp" not in spec.levels:
        log.info("%s: 4-bit loading quantizes attention to NF4; the experts stay %s (NF4 experts need Kestrel's "
                 "patched MoE block: patch=True)", path, next(model.parameters()).dtype)
        return
    quant = quantize_experts(model, spec)
    log.info("%s: 4-bit loading quantizes attention and the experts to NF4 (experts: %.2f GB)", path, quant.nbytes / 1e9)
