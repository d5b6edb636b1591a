"""Checking an exported model against the Hugging Face model it came from.

    refs = reference_runs(src.model_dir, src.adapter_dir, tokenizer)   # HF greedy, fp32, adapter unmerged
    gguf = check_gguf(path, refs, exact=True)                          # llama.cpp itself
    gguf.passed, gguf.top1_agreement

The reference is the plain Hugging Face model in fp32 with the PEFT adapter applied unmerged, so
the merge, the layout changes and the quantization are all checked at once. For each prompt the
reference generates 32 tokens greedily; llama.cpp then evaluates prompt + those tokens in one
batch (teacher forcing) and its top-1 token is compared at every position. Teacher forcing keeps
one disagreement from cascading, so agreement is a per-position rate. For a 16-bit file the
generated tokens must all agree (the greedy output is then identical), except where the
reference's top two logits are within TIE_TOL of the logits' standard deviation: there any
rounding picks either, and the position is counted as a tie, not a failure. (f16 weights and
activations move the demo model's logits by well under TIE_TOL.)

A mixture of experts has a second kind of tie: where a router's k-th and (k+1)-th expert scores
are within TIE_TOL of that router row's standard deviation, rounding may send the token to another
expert, which moves that position's logits by far more than a logit tie would allow. The reference
records, at every position, the smallest such router margin over the layers (`route_margin`);
a position that differs there counts as a routing tie, not a failure.

Every llama.cpp call runs in a child process (`kestrel.export.llama_child`): a crash there is a
clear error naming the stage, not the end of this process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kestrel.export import llama_child
from kestrel.export.llama_child import run_in_child
from kestrel.model.safe_weights import refuse_pickled

N_NEW = 32
TIE_TOL = 0.02  # x logit std: top-2 closer than this is a tie that 16-bit rounding may flip
MMPROJ_TOL = 0.02  # x embedding std: image embeddings of the f16 projector file vs fp32 Hugging Face
PROMPTS = ("What is 12 + 7?", "Reverse the word. apple", "Write one short sentence about rivers.")
TEST_TEXTS = (
    "Hello world. The quick brown fox jumps over the lazy dog 12345 times!",
    "  leading spaces,\ttabs\nnew lines\n\n and   runs of spaces   ",
    "héllo wörld, naïve café; ünïcödé, 日本語 and emoji 🙂",
    "What's the answer? It's 42. They'll see, we've done it, I'm sure. 3.14159 1,000,000",
    "def f(x):\n    return x ** 2  # comment\n",
)


@dataclass
class ReferenceRun:
    prompt_ids: list[int]
    tokens: list[int]  # greedy continuation, N_NEW tokens
    logits: np.ndarray  # (len(prompt_ids) + N_NEW - 1, vocab) fp32, at every evaluated position
    rounded: np.ndarray | None = None  # the same with the merged weights rounded to 16 bits (see reference_runs)
    route_margin: np.ndarray | None = None  # (positions,) smallest top-k router margin over layers, x row std; MoE only


@dataclass
class GGUFCheck:
    passed: bool
    exact_required: bool
    top1_agreement: float  # over generated positions, all prompts
    prompt_top1_agreement: float  # over prompt positions
    ties: int = 0
    greedy_identical: bool = False
    sample: str = ""  # llama.cpp's own top-1 continuation of the first prompt, decoded
    problems: list[str] = field(default_factory=list)
    prompt_ties: int = 0  # prompt positions that differ where the reference's top two are within the tie tolerance
    prompt_beyond_ties: int = 0  # prompt positions that differ beyond both tie tolerances
    route_ties: int = 0  # generated positions that differ beyond the logit tie where a router was near a tie
    prompt_route_ties: int = 0  # prompt positions likewise


@dataclass
class TokenizerCheck:
    text_mismatches: list[str] = field(default_factory=list)  # plain text, BOS/EOS as the tokenizer adds them
    chat_mismatches: list[str] = field(default_factory=list)  # prompts rendered by the chat template

    @property
    def matches(self) -> bool:
        return not self.text_mismatches and not self.chat_mismatches

    def cost(self) -> tuple[int, int]:
        """Chat prompts first: they are what the exported model reads in use."""
        return len(self.chat_mismatches), len(self.text_mismatches)


def prompt_ids(tokenizer: Any, prompts: tuple[str, ...] = PROMPTS) -> list[list[int]]:
    """Each prompt as one user message, rendered by the chat template with the assistant header."""
    out = []
    for text in prompts:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)
        out.append(list(enc["input_ids"]))
    return out


def load_reference(model_dir: Path, adapter_dir: Path | None, device: str | None = None, tensors: Any = None) -> Any:
    """The plain Hugging Face model in fp32, with the adapter applied unmerged by PEFT. A base
    stored 4-bit is built from its dequantized tensors (`tensors`, an `kestrel.export.merge.ModelTensors`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from kestrel.model.multimodal import is_image_text

    auto = AutoModelForImageTextToText if is_image_text(AutoConfig.from_pretrained(model_dir)) else AutoModelForCausalLM
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if tensors is not None and tensors.dequantized:
        config = AutoConfig.from_pretrained(model_dir)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = auto.from_config(config, dtype=torch.float32)
        state = {name: tensors.base(name) for name in tensors.base_names()}
        model.load_state_dict(state, strict=False)  # a tied lm_head is not in the checkpoint
        model.tie_weights()
    else:  # loaded straight onto the device: an 8B model in fp32 never passes through host memory
        model = auto.from_pretrained(model_dir, dtype=torch.float32, device_map={"": dev}, use_safetensors=True)
    model = model.to(dev)
    if dev == "cpu":
        _cpu_linear_attention(model)
    if adapter_dir is not None:
        from peft import PeftModel

        refuse_pickled(adapter_dir)
        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def _cpu_linear_attention(model: Any) -> None:
    """Hugging Face binds flash-linear-attention's kernels (CUDA only) at import whenever the package
    is installed, so a Qwen3.5 model fails on the CPU; there its linear-attention layers run HF's
    math with HF's PyTorch functions (`kestrel.model.linear_attention`)."""
    import types

    from kestrel.model.linear_attention import linear_attention_forward
    from kestrel.model.registry import family_for

    spec = family_for(model.config)
    if spec is None or spec.linear_attention_class is None:
        return
    for module in model.modules():
        if type(module).__name__ == spec.linear_attention_class:
            module.forward = types.MethodType(linear_attention_forward, module)


def experts_per_token(model: Any) -> int | None:
    """k of a mixture-of-experts model's top-k routing, None for a dense model."""
    k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    return int(k) if k else None


def route_margins(router_logits: tuple[torch.Tensor, ...], k: int) -> torch.Tensor:
    """(tokens,) for each token, min over layers of (s_k - s_(k+1)) / std(s), s the layer's router
    scores (tokens, experts) sorted descending: how close the token came to another expert set."""
    margins = []
    for scores in (s.float() for s in router_logits):
        top = scores.topk(k + 1, dim=-1).values
        margins.append((top[:, k - 1] - top[:, k]) / scores.std(dim=-1).clamp_min(1e-12))
    return torch.stack(margins).amin(0)


@torch.no_grad()
def greedy(model: Any, ids: list[int], n_new: int = N_NEW) -> ReferenceRun:
    """Greedy decoding without stopping at EOS; logits (and for a mixture of experts, router
    margins) kept at every position."""
    dev = next(model.parameters()).device
    k = experts_per_token(model)
    routed = {"output_router_logits": True} if k else {}
    rows: list[torch.Tensor] = []
    margins: list[torch.Tensor] = []
    out, tokens = None, []
    for step in range(n_new):
        feed = torch.tensor([ids] if step == 0 else [[tokens[-1]]], device=dev)
        out = model(feed, past_key_values=out and out.past_key_values, use_cache=True, **routed)
        rows.append(out.logits[0].float().cpu())
        if k:
            margins.append(route_margins(out.router_logits, k).cpu())
        tokens.append(int(rows[-1][-1].argmax()))
    return ReferenceRun(ids, tokens, torch.cat(rows).numpy(),
                        route_margin=torch.cat(margins).numpy() if k else None)


@torch.no_grad()
def full_logits(model: Any, seq: list[int]) -> np.ndarray:
    """(len(seq), vocab) fp32 logits of one forward pass."""
    dev = next(model.parameters()).device
    return model(torch.tensor([seq], device=dev)).logits[0].float().cpu().numpy()


def reference_runs(model_dir: Path, adapter_dir: Path | None, tokenizer: Any, device: str | None = None,
                   tensors: Any = None, round_to: torch.dtype | None = None) -> list[ReferenceRun]:
    """Greedy runs of the reference model on the default prompts, rendered by the chat template.

    With `round_to` (a 16-bit dtype), each run also gets `rounded`: the logits after PEFT merges
    the adapter (in fp32) and every weight is rounded to that dtype. That is the error storing
    the merged model in 16 bits causes by itself, the yardstick for a merged 16-bit export."""
    model = load_reference(model_dir, adapter_dir, device, tensors)
    try:
        runs = [greedy(model, ids) for ids in prompt_ids(tokenizer)]
        if round_to is not None and round_to != torch.float32:
            if adapter_dir is not None:
                model.merge_adapter()
            for name, param in model.named_parameters():
                if "lora_" not in name:
                    param.data = param.data.to(round_to).float()
            for run in runs:
                run.rounded = full_logits(model, run.prompt_ids + run.tokens[:-1])
        return runs
    finally:
        del model


def _mismatch(text: str, hf: list[int], ours: list[int]) -> str:
    first = next((i for i, (a, b) in enumerate(zip(hf, ours)) if a != b), min(len(hf), len(ours)))
    return f"{text[:40]!r}: from token {first}, Hugging Face {hf[first:first + 6]}, llama.cpp {ours[first:first + 6]}"


def check_tokenizer(path: Path, tokenizer: Any, texts: tuple[str, ...] = TEST_TEXTS) -> TokenizerCheck:
    """Tokenize `texts` with llama.cpp and Hugging Face: plain text with the tokenizer's own
    BOS/EOS rule (llama.cpp reads it from the GGUF), and chat-rendered prompts as they are."""
    result = TokenizerCheck()
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             for t in texts]
    items = [(text, True) for text in texts] + [(text, False) for text in chats]
    stage = f"loading the vocabulary of {path.name} and tokenizing test texts (the tokenizer check)"
    found = run_in_child(stage, llama_child.tokenize, path, items)
    for (text, add_special), ours in zip(items, found):
        hf = tokenizer(text, add_special_tokens=add_special)["input_ids"]
        if ours != hf:
            (result.text_mismatches if add_special else result.chat_mismatches).append(_mismatch(text, hf, ours))
    return result


def check_gguf(path: Path, refs: list[ReferenceRun], exact: bool, tie_tol: float = TIE_TOL) -> GGUFCheck:
    """Load `path` with llama.cpp and compare its top-1 tokens with the references'.

    `exact`: every generated position must agree (ties within `tie_tol` x the reference logits'
    standard deviation excepted, and routing ties within `tie_tol` of a router row's: see the
    module docstring); otherwise the agreement is only reported and the file passes when it loads
    and gives finite logits."""
    longest = max(len(r.prompt_ids) + N_NEW for r in refs)
    seqs = [r.prompt_ids + r.tokens[:-1] for r in refs]
    stage = f"loading {path.name} and evaluating the test prompts (the {path.name} check)"
    try:
        all_scores, sample = run_in_child(stage, llama_child.evaluate, path, seqs, longest + 16,
                                          len(refs[0].prompt_ids) - 1)
    except (ValueError, RuntimeError) as exc:
        return GGUFCheck(False, exact, 0.0, 0.0, problems=[f"llama.cpp could not load {path.name}: {exc}"])
    gen_ok = gen_n = prompt_ok = prompt_n = 0
    counts = {"tie": [0, 0], "route": [0, 0], "beyond": [0, 0]}  # kind -> [prompt, generated] positions
    problems: list[str] = []
    for i, (ref, ours) in enumerate(zip(refs, all_scores)):
        theirs = ref.logits
        if ours.shape != theirs.shape or not np.isfinite(ours).all():
            problems.append(f"prompt {i}: llama.cpp gave logits of shape {ours.shape}, the reference "
                            f"{theirs.shape}, finite: {bool(np.isfinite(ours).all())}")
            continue
        top = ours.argmax(-1)
        agree = top == theirs.argmax(-1)
        n_prompt = len(ref.prompt_ids) - 1
        prompt_ok, prompt_n = prompt_ok + int(agree[:n_prompt].sum()), prompt_n + n_prompt
        gen_ok, gen_n = gen_ok + int(agree[n_prompt:].sum()), gen_n + len(agree) - n_prompt
        tol = tie_tol * float(theirs.std())
        for pos in np.flatnonzero(~agree):
            kind, margin = _difference(ref, top, int(pos), tol, tie_tol)
            counts[kind][int(pos >= n_prompt)] += 1
            if kind == "beyond" and exact and pos >= n_prompt:
                problems.append(f"prompt {i}: token {pos - n_prompt} differs ({int(top[pos])} vs "
                                f"{int(theirs[pos].argmax())}, reference margin {margin:.3f})")
    identical = gen_n > 0 and gen_ok == gen_n
    passed = not problems and gen_n > 0
    return GGUFCheck(passed, exact, gen_ok / max(gen_n, 1), prompt_ok / max(prompt_n, 1), ties=counts["tie"][1],
                     greedy_identical=identical, sample=sample, problems=problems[:5], prompt_ties=counts["tie"][0],
                     prompt_beyond_ties=counts["beyond"][0], route_ties=counts["route"][1],
                     prompt_route_ties=counts["route"][0])


def _difference(ref: ReferenceRun, top: np.ndarray, pos: int, tol: float, route_tol: float) -> tuple[str, float]:
    """Why llama.cpp's top-1 `top[pos]` differs from the reference's there: "tie" (the reference's
    logits of the two tokens within `tol`), "route" (a router within `route_tol` x its row's std
    of another expert set there), else "beyond"; and the logit margin."""
    row = ref.logits[pos]
    margin = float(row.max() - row[top[pos]])
    if margin <= tol:
        return "tie", margin
    if ref.route_margin is not None and ref.route_margin[pos] <= route_tol:
        return "route", margin
    return "beyond", margin


def check_template(path: Path, tokenizer: Any, messages: list[dict[str, str]]) -> dict[str, Any]:
    """Render `messages` with the template embedded in the GGUF (Jinja, as llama-cpp-python and
    `llama-server --jinja` do, and with llama.cpp's built-in formats) and with the tokenizer."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # Python only: no llama.cpp call here

    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    stage = f"reading the chat template of {path.name} (the template check)"
    embedded, builtin = run_in_child(stage, llama_child.chat_template, path, messages)
    if embedded is None:
        return {"embedded": False, "jinja_matches": False, "builtin_matches": None}
    jinja = Jinja2ChatFormatter(embedded, tokenizer.eos_token or "", tokenizer.bos_token or "")(messages=messages).prompt
    bos = tokenizer.bos_token or ""
    strip = (lambda s: s[len(bos):] if bos and s.startswith(bos) else s)
    return {
        "embedded": True,
        "jinja_matches": jinja == expected,
        # llama.cpp's own formats leave BOS to the tokenizer
        "builtin_matches": None if builtin is None else strip(builtin) == strip(expected),
    }


def check_mmproj(mmproj: Path, model_path: Path, model_dir: Path, tol: float = MMPROJ_TOL) -> dict[str, Any]:
    """Encode one synthetic image with llama.cpp's mtmd (the projector file `mmproj` beside the
    language model's `model_path`) and with Hugging Face's image-text model in `model_dir` (fp32):
    the image embeddings (n_tokens, text hidden) must agree within `tol` x the reference's std."""
    from transformers import AutoModelForImageTextToText

    from kestrel.export.mmproj import PROJECTORS, image_stats

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    projector = PROJECTORS[model.config.model_type]
    size = projector.check_side(model.config)  # a size clip encodes as it is: no resize on either side
    gen = np.random.default_rng(0)
    rgb = gen.integers(0, 256, (size, size, 3), dtype=np.uint8)  # (H, W, 3)
    mean, std = (torch.tensor(v, dtype=torch.float32)[:, None, None] for v in image_stats(model_dir, model.config))
    pixels = (torch.from_numpy(rgb).permute(2, 0, 1).float() / 255 - mean) / std  # (3, H, W)
    with torch.no_grad():
        out = model.model.get_image_features(**projector.hf_inputs(pixels, model.config))
        ref = projector.expected(out.pooler_output[0].float().numpy(), model, model_dir)  # (n_tokens, hidden)
    del model
    stage = f"loading {mmproj.name} with llama.cpp's mtmd and encoding an image (the projector check)"
    try:
        ours = run_in_child(stage, llama_child.encode_image, model_path, mmproj, rgb.tobytes(), (size, size))
    except llama_child.LlamaCrashError as e:  # clip aborts on tensors of shapes it does not expect: a wrong file
        return {"passed": False, "file": mmproj.name, "problems": [str(e)]}
    if ours is None:
        return {"passed": False, "file": mmproj.name, "problems": ["llama.cpp's mtmd could not load the projector file"]}
    if ours.shape != ref.shape:
        return {"passed": False, "file": mmproj.name,
                "problems": [f"llama.cpp gave {ours.shape} image embeddings, Hugging Face {ref.shape}"]}
    error = float(np.abs(ours - ref).max() / ref.std())
    return {"passed": error <= tol, "file": mmproj.name, "n_tokens": int(ref.shape[0]), "max_error": error,
            "tolerance": tol}
