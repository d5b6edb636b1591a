"""Peak GPU memory of a training run, estimated from the model's config before anything loads.

    shape = shape_from_config(json.load(open("model/config.json")))
    est = estimate_training_memory(shape, method="qlora", lora_r=16, batch_size=2, max_seq_length=2048)
    verdict(est.total_bytes, capacity_bytes)          # "fits" | "tight" | "will not fit"
    host_verdict(est, detect_host_memory())           # the same for host RAM; None: nothing to judge

The model of memory (bytes), written for the way the engine trains:
- base weights: 2 per parameter in 16-bit; QLoRA stores the linear layers of the blocks in NF4
  (0.5 per parameter plus about 0.04 of block scales with double quantization) and keeps the
  embeddings, the head and the norms in 16-bit.
- LoRA: r * (in + out) parameters per targeted linear, kept in fp32 by PEFT: weight, gradient
  and two AdamW moments = 16 per trainable parameter. Full fine-tuning: bf16 weight, gradient
  and AdamW moments in the parameter's dtype = 8 per parameter.
- activations, per token (16-bit values, h = hidden, i = intermediate), fitted to the 8B shape's
  measured peaks (bench/RESULTS.md, "Figures moved out of code comments"):
  - `off` keeps every layer's saved tensors, (5 h + 2 i) a token a layer (the MLP keeps its gate
    and up products).
  - `standard` keeps each layer's input (h a token a layer) and recomputes one layer at a time;
    `offload` keeps the layer inputs in host memory and two in flight on the GPU. A recomputed
    layer's backward holds 12 h a token besides its MLP, whose E, G and h (3 i a token) are
    kept whole for short rows; beyond `kestrel.kernels.lora.mlp.lowers_peak`'s point (4,779 rows at the 8B
    shape in QLoRA, 2,048 in 16-bit) the MLP runs in chunks of 2,048 rows instead, over dense
    copies of the NF4 gate and up weights. That is the default (`performance.defer_mlp: memory`);
    `fit` (`kestrel.recompute.mlp_deferral`) keeps whole rows, and pages their E out, only where the
    device and the host have room for them when the run gets there, so the estimate counts neither.
    The model errs above the measured allocated peaks
    (it counts the CUDA context). The allocator reserves more: cached blocks, which it frees
    and retries with before it reports out-of-memory.
  The loss is chunked (logits never exist for the whole batch), so the head costs one chunk.
- GRPO adds the rollouts' static KV cache and trains on num_generations sequences per prompt;
  linear-attention layers (Qwen3.5) hold a fixed-size recurrent state per sequence instead.
- per family: Qwen3.5's linear-attention projections and gated q_proj, Gemma 4's per-layer
  inputs and wider full-attention heads (`per_layer_config`) count in the parameters.
- a fixed overhead for the CUDA context and allocator slack (0.6 GiB + 8 %).
- host RAM (`offload_host_ram`, not part of the GPU total): `offload` keeps every layer's input in
  page-locked host memory, layers x tokens x hidden x 2 bytes (100 GiB at 409,600 tokens on the
  8B shape), and where the MLP keeps its gate product E (rows short of its deferral point, a dense
  MLP) it pages E out too, in `performance.offload_gate` of the layers: tokens x intermediate x 2
  bytes each (3.5 GiB more at 2 x 2,048 tokens on the 8B shape, against 1 GiB of inputs); with
  `performance.keep_attention: on`, each attention layer's output and logsumexp too, tokens x heads x
  (head_dim x 2 + 4) bytes, and with `keep_projection: on` the output projection's output, tokens x
  hidden x 2, with `keep_qkv: on` Q, K and V, tokens x (heads + 2 kv_heads) x head_dim x 2 (`auto`, the
  default, keeps them only where half the host memory then available holds
  them with the inputs, so they are not counted as needed).
  Pinned pages cannot be swapped out, so this must fit the machine's RAM. 0 otherwise.
- mixture of experts (Qwen3-MoE, gpt-oss, Qwen3.5-MoE): every expert's weights count (E x 3 h ie, plus the
  router's E h); QLoRA stores the experts in NF4 too (`kestrel.model.expert_quant`; the router
  stays 16-bit) and dequantizes one projection of one layer's experts at a time into a 16-bit
  workspace, E 2 ie h x 2 bytes (gate_up, the larger). LoRA on the MLP targets puts per-expert factors on the experts,
  E r (h + 2 ie) + E r (ie + h) a layer. Activations use the k routed experts' intermediate,
  k ie a token, plus the token rows copied into expert order and back (2 k h). A shared expert
  (Qwen3.5-MoE: intermediate s) is a dense MLP of linears beside them (NF4 under QLoRA, LoRA on
  the MLP targets) that every token runs: s more intermediate a token; its gate (h -> 1) counts
  with the router.
- several devices (`devices: N`, `kestrel.training.distributed`), the estimate is per GPU:
  - full fine-tuning is sharded with FSDP2 (each decoder layer one unit, then the root:
    embeddings, final norm, head), so weights (2 P), gradients and AdamW moments (6 P) divide by
    N. On top of the shards (`communication`): the root's parameters stay gathered for the whole
    step (FSDP2 keeps the root unsharded between forward and backward) and its full gradients
    exist until the reduce-scatter after the backward, 4 bytes a root parameter; two decoder
    layers are gathered at once (the running one and the prefetched next), 2 bytes a parameter
    each, and the running layer's unsharded gradient before its reduce-scatter, 2 more.
  - LoRA / QLoRA keep the base replicated on each GPU (as on one); the adapters' gradients are
    summed through one flat fp32 buffer (4 bytes a trainable parameter).
  - activations are each GPU's own micro-batch (`batch_size` rows a rank), as on one device; GRPO's
    rollouts too (each rank decodes `batch_size` prompts x `num_generations` at a time).
  On the CPU (gloo) each rank is a process with this much RAM.
These are estimates to within about 20 %: the verdict leaves a margin for that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from kestrel.config import PerformanceSettings
from kestrel.constants import DEFERRED_ROWS, PREFERENCE_METHODS
from kestrel.model.registry import family_of
from kestrel.recompute.gate_share import paged_gate_layers

GIB = 2**30
FITS_BELOW = 0.80  # of the card's memory: room for the estimate's error
TIGHT_BELOW = 1.00
NF4_BYTES = 0.5 + 0.04  # 4-bit codes + double-quantized absmax per 64-block
CONTEXT_BYTES = int(0.6 * GIB)
SLACK = 0.08
LOSS_CHUNK_TOKENS = 1024  # tokens whose logits exist at once in the chunked loss
# Activations, in 16-bit values a token (module docstring): fitted to the 8B shape's peaks.
SAVED_HIDDENS, SAVED_INTERMEDIATES = 5, 2  # one layer's saved tensors, no checkpointing
RECOMPUTE_HIDDENS = 12  # a recomputed layer's backward, besides its MLP


@dataclass(frozen=True)
class LinearAttentionShape:
    """Gated-delta-rule layers (Qwen3.5): head counts and sizes of keys and values, conv width."""

    layers: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv: int

    def linears(self, hidden: int) -> dict[str, tuple[int, int]]:
        keys, values = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        return {"in_proj_qkv": (hidden, 2 * keys + values), "in_proj_z": (hidden, values),
                "in_proj_b": (hidden, self.v_heads), "in_proj_a": (hidden, self.v_heads), "out_proj": (values, hidden)}

    def state_bytes(self) -> int:
        """One sequence's decode state: the fp32 (dk x dv) matrix per value head and the
        convolution's last (w - 1) inputs, per layer."""
        conv_dim = 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
        return self.layers * (self.v_heads * self.k_dim * self.v_dim * 4 + conv_dim * (self.conv - 1) * 2)


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide memory, read from a Hugging Face `config.json`."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    attn_output_gate: bool = False  # q_proj also yields a gate per head (Qwen3.5)
    linear_attention: LinearAttentionShape | None = None  # these layers hold no K/V
    per_layer_embedding: int = 0  # parameters of per-layer inputs (Gemma 4), `_per_layer_inputs`
    # Attention layers whose head size or K/V head count differ from the above (Gemma 4's full
    # layers): (layer count, head_dim, kv_heads) each; the other attention layers use the above.
    wider_attention: tuple[tuple[int, int, int], ...] = ()
    experts: int = 0  # mixture of experts: experts per layer (0 for a dense model)
    experts_per_token: int = 0  # k, the experts each token is routed to
    expert_intermediate: int = 0  # one expert's intermediate size
    shared_expert_intermediate: int = 0  # the shared expert's intermediate (Qwen3.5-MoE); 0 without one

    @property
    def expert_params(self) -> int:
        """Every layer's experts (gate, up, down) and router (and the shared expert's gate)."""
        gate = self.hidden if self.shared_expert_intermediate else 0
        return self.layers * (self.experts * (3 * self.hidden * self.expert_intermediate + self.hidden) + gate)

    @property
    def active_intermediate(self) -> int:
        """The MLP intermediate a token's activations hold: k experts' worth in a MoE (and the shared expert's)."""
        if not self.experts:
            return self.intermediate
        return self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate

    @property
    def expert_weight_params(self) -> int:
        """The experts' gate, up and down weights of every layer (NF4 under QLoRA), without the routers."""
        return self.layers * self.experts * 3 * self.hidden * self.expert_intermediate

    def expert_lora_params(self, r: int) -> int:
        """Per-expert LoRA factors of gate_up (h -> 2 ie) and down (ie -> h), all layers."""
        h, ie = self.hidden, self.expert_intermediate
        return self.layers * self.experts * r * ((h + 2 * ie) + (ie + h))

    @property
    def attention_layers(self) -> int:
        return self.layers - (self.linear_attention.layers if self.linear_attention else 0)

    def attention_kinds(self) -> list[tuple[int, int, int]]:
        """(layer count, head_dim, kv_heads) of each kind of attention layer."""
        plain = self.attention_layers - sum(n for n, _, _ in self.wider_attention)
        return [(plain, self.head_dim, self.kv_heads), *self.wider_attention]

    def linear_groups(self) -> list[tuple[int, dict[str, tuple[int, int]]]]:
        """(layer count, {module name: (in, out)}) for each kind of linear of the blocks."""
        h, i = self.hidden, self.intermediate
        groups = []
        for n, head_dim, kv_heads in self.attention_kinds():
            q, kv = self.heads * head_dim, kv_heads * head_dim
            groups.append((n, {"q_proj": (h, 2 * q if self.attn_output_gate else q), "k_proj": (h, kv),
                               "v_proj": (h, kv), "o_proj": (q, h)}))
        # A MoE's MLP is its experts (`expert_params`), not linears, and its shared expert if any.
        i = self.shared_expert_intermediate if self.experts else i
        if i:
            groups.append((self.layers, {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}))
        if self.linear_attention:
            groups.append((self.linear_attention.layers, self.linear_attention.linears(h)))
        return groups

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear of the blocks, by module name."""
        return {name: shape for _, linears in self.linear_groups() for name, shape in linears.items()}

    @property
    def block_linear_params(self) -> int:
        return sum(n * sum(a * b for a, b in linears.values()) for n, linears in self.linear_groups())

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.per_layer_embedding

    @property
    def params(self) -> int:
        return self.block_linear_params + self.expert_params + self.embedding_params + (2 * self.layers + 1) * self.hidden

    @property
    def largest_layer_params(self) -> int:
        """Parameters of the largest decoder layer: its attention (or linear-attention)
        projections, its MLP (in a MoE every expert, the router and the shared expert with its
        gate) and its two norms."""
        mixers, mlp = [0], 0
        for _, linears in self.linear_groups():
            size = sum(a * b for a, b in linears.values())
            if "gate_proj" in linears:  # the dense MLP, or a MoE's shared expert
                mlp += size
            else:
                mixers.append(size)
        return max(mixers) + mlp + self.expert_params // self.layers + 2 * self.hidden

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, head, final norm."""
        return self.embedding_params + self.hidden


def _moe_sizes(cfg: dict[str, Any]) -> dict[str, int]:
    """Expert count, k, expert and shared-expert intermediates of a MoE config (Qwen3-MoE: num_experts
    and moe_intermediate_size; gpt-oss: num_local_experts and intermediate_size; Qwen3.5-MoE: also
    shared_expert_intermediate_size); empty when dense."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if not experts:
        return {}
    return dict(experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                expert_intermediate=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                shared_expert_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0))


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """A ModelShape from a config dict (multimodal configs: their `text_config`)."""
    cfg = config.get("text_config") or config
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        spec = family_of(str(cfg.get("model_type", "")))
        shape = ModelShape(
            vocab=int(cfg["vocab_size"]), hidden=hidden, layers=layers, heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg.get("intermediate_size") or 4 * hidden),
            tied=bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            attn_output_gate=bool(spec and spec.attn_output_gate),
            linear_attention=_linear_attention(cfg),
            per_layer_embedding=_per_layer_inputs(cfg, layers, hidden),
            wider_attention=_per_layer_attention(cfg, heads, hidden),
            **_moe_sizes(cfg),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the model config lacks the sizes needed for an estimate ({exc})") from exc
    return shape


def _per_layer_inputs(cfg: dict[str, Any], layers: int, hidden: int) -> int:
    """Parameters of Gemma 4's per-layer inputs: a (vocab, layers x p) embedding, the projection of
    the hidden state to it, and each layer's gate and projection back (hidden x p each)."""
    p = int(cfg.get("hidden_size_per_layer_input") or 0)
    return (int(cfg.get("vocab_size_per_layer_input") or 0) + hidden) * layers * p + layers * 2 * hidden * p


def _per_layer_attention(cfg: dict[str, Any], heads: int, hidden: int) -> tuple[tuple[int, int, int], ...]:
    """Counts of attention layers that `per_layer_config` (layer index -> overrides) gives another
    head_dim or K/V head count, by (head_dim, kv_heads)."""
    base = (int(cfg.get("head_dim") or hidden // heads), int(cfg.get("num_key_value_heads") or heads))
    counts: dict[tuple[int, int], int] = {}
    for overrides in (cfg.get("per_layer_config") or {}).values():
        kind = (int(overrides.get("head_dim", base[0])), int(overrides.get("num_key_value_heads", base[1])))
        if kind != base:
            counts[kind] = counts.get(kind, 0) + 1
    return tuple((n, head_dim, kv) for (head_dim, kv), n in counts.items())


def _linear_attention(cfg: dict[str, Any]) -> LinearAttentionShape | None:
    layers = sum(1 for kind in cfg.get("layer_types") or [] if kind == "linear_attention")
    if not layers:
        return None
    return LinearAttentionShape(
        layers=layers, k_heads=int(cfg["linear_num_key_heads"]), v_heads=int(cfg["linear_num_value_heads"]),
        k_dim=int(cfg["linear_key_head_dim"]), v_dim=int(cfg["linear_value_head_dim"]),
        conv=int(cfg.get("linear_conv_kernel_dim") or 4),
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of each part of the peak, and their total."""

    weights: int
    trainable: int  # trainable parameter count
    optimizer: int  # trainable weights' fp32/bf16 copies, gradients and AdamW moments
    activations: int
    extra: int  # GRPO rollout cache and logits chunk
    overhead: int
    offload_host_ram: int = 0  # pinned host RAM of the offloaded layer inputs; not GPU memory
    communication: int = 0  # several devices: FSDP2's gathered weights and unsharded gradients, LoRA's all-reduce buffer
    devices: int = 1  # the figures are per device of this many

    @property
    def total_bytes(self) -> int:
        return self.weights + self.optimizer + self.activations + self.extra + self.overhead + self.communication


def training_rows(method: str, finetune: str, batch_size: int) -> tuple[str, int]:
    """(what a run trains like, rows in one training forward). A preference method trains as its
    `finetune` (lora, qlora, full); paired ones (DPO, ORPO, SimPO) run chosen and rejected rows
    together, twice `batch_size` rows."""
    if method not in PREFERENCE_METHODS:
        return method, batch_size
    return finetune, batch_size * (1 if method == "kto" else 2)


def estimate_training_memory(
    shape: ModelShape, method: str = "lora", lora_r: int = 16, lora_targets: list[str] | None = None,
    batch_size: int = 2, max_seq_length: int = 2048, gradient_checkpointing: str = "standard",
    num_generations: int = 8, max_completion_length: int = 256, max_prompt_length: int = 512, devices: int = 1,
    offload_gate: float = 1.0, keep_attention: str = PerformanceSettings.keep_attention,
    keep_projection: str = PerformanceSettings.keep_projection, keep_qkv: str = PerformanceSettings.keep_qkv,
) -> MemoryEstimate:
    """Peak training memory of `shape` under these settings, per device of `devices` (see the
    module docstring)."""
    # weights
    nf4 = shape.block_linear_params + shape.expert_weight_params
    if method == "qlora":
        workspace = 2 * shape.experts * 2 * shape.expert_intermediate * shape.hidden  # one layer's gate_up in 16-bit
        weights = int(nf4 * NF4_BYTES) + 2 * (shape.params - nf4) + workspace
    else:
        weights = 2 * shape.params
    # trainable parameters and their optimizer state
    if method == "full":
        trainable = shape.params
        optimizer = 6 * trainable  # gradient + two moments, bf16 (weights counted above)
    else:
        targets = lora_targets or list(shape.linear_shapes)
        trainable = sum(n * sum(lora_r * (a + b) for name, (a, b) in linears.items() if name in targets)
                        for n, linears in shape.linear_groups())
        if shape.experts and (lora_targets is None or {"gate_proj", "up_proj", "down_proj"} & set(targets)):
            trainable += shape.expert_lora_params(lora_r)
        optimizer = 16 * trainable
    # activations: GRPO trains on every generation of a prompt at full rollout length
    if method == "grpo":
        seqs, length = batch_size * num_generations, max_prompt_length + max_completion_length
    else:
        seqs, length = batch_size, max_seq_length
    tokens = seqs * length
    activations = _activations(shape, method == "qlora", tokens, gradient_checkpointing)
    logits = min(tokens, LOSS_CHUNK_TOKENS) * shape.vocab * 4  # one fp32 chunk; its gradient reuses it
    kv_cache = 0
    if method == "grpo":  # rollouts: K/V of the attention layers, the recurrent state of linear ones
        kv_cache = sum(2 * n * seqs * length * kv * head_dim * 2 for n, head_dim, kv in shape.attention_kinds())
        kv_cache += seqs * (shape.linear_attention.state_bytes() if shape.linear_attention else 0)
    extra = logits + kv_cache
    weights, optimizer, communication = _per_device(shape, method, weights, optimizer, trainable, devices)
    overhead = CONTEXT_BYTES + int(SLACK * (weights + optimizer + activations + extra + communication))
    # offload moves the same layer inputs `standard` keeps on the GPU into pinned host memory, and
    # `offload_gate` of the layers their MLP gate products
    host = 0
    if gradient_checkpointing == "offload":
        host = shape.layers * tokens * shape.hidden * 2 + _paged_gates(shape, method == "qlora", tokens, offload_gate)
        if keep_attention == "on":  # outputs, logsumexps (auto keeps them only where the host has room)
            host += sum(n * tokens * shape.heads * (head_dim * 2 + 4) for n, head_dim, _ in shape.attention_kinds())
            if keep_projection == "on":  # and the output projections' outputs
                host += shape.attention_layers * tokens * shape.hidden * 2
            if keep_qkv == "on":  # and Q (with Qwen3.5's gate half), K and V
                queries = shape.heads * (2 if shape.attn_output_gate else 1)
                host += sum(n * tokens * (queries + 2 * kv) * head_dim * 2 for n, head_dim, kv in shape.attention_kinds())
    return MemoryEstimate(weights, trainable, optimizer, activations, extra, overhead, host, communication, devices)


def _per_device(shape: ModelShape, method: str, weights: int, optimizer: int, trainable: int,
                devices: int) -> tuple[int, int, int]:
    """(weights, optimizer state, communication buffers) on each of `devices` (module docstring:
    several devices): a full fine-tune's shards plus FSDP2's gathered root and two layers; LoRA's
    replicated base plus the flat gradient buffer of its all-reduce."""
    if devices <= 1:
        return weights, optimizer, 0
    if method != "full":
        return weights, optimizer, 4 * trainable
    layer = shape.largest_layer_params
    gathered = 4 * shape.root_params + 2 * 2 * layer + 2 * layer
    return -(-weights // devices), -(-optimizer // devices), gathered


def _mlp_values(tokens: int, h: int, i: int, qlora: bool) -> tuple[int, int]:
    """(whole, deferred): values a recomputed MLP holds keeping E, G, h for all `tokens` rows, and
    deferred to its backward in chunks over dense gate/up weights (`kestrel.kernels.lora.mlp.lowers_peak`
    takes the smaller)."""
    dense = 2 * h * i if qlora else 0
    return 3 * tokens * i, 3 * min(tokens, DEFERRED_ROWS) * i + dense


def _paged_gates(shape: ModelShape, qlora: bool, tokens: int, share: float) -> int:
    """Host bytes of the gate products E (tokens x intermediate, 16-bit) that offload pages out: a
    `share` of the layers (`kestrel.recompute.gate_share`), and only where the MLP keeps E, i.e.
    does not defer. A mixture of experts' sparse blocks keep no E aside."""
    whole, deferred = _mlp_values(tokens, shape.hidden, shape.intermediate, qlora)
    if shape.experts or deferred < whole:
        return 0
    return paged_gate_layers(shape.layers, share) * tokens * shape.intermediate * 2


def _activations(shape: ModelShape, qlora: bool, tokens: int, checkpointing: str) -> int:
    """GPU bytes of activations at the peak (module docstring: activations)."""
    h, i = shape.hidden, shape.active_intermediate
    rows = 2 * shape.experts_per_token * h  # a MoE's token rows in expert order and back
    if checkpointing == "off":
        return shape.layers * tokens * (SAVED_HIDDENS * h + SAVED_INTERMEDIATES * i + rows) * 2
    # the recomputed MLP: E, G, h whole, or chunked over dense gate/up weights (kestrel.kernels.lora.mlp)
    mlp = min(_mlp_values(tokens, h, i, qlora)) * 2
    recompute = tokens * (RECOMPUTE_HIDDENS * h + rows) * 2 + mlp
    kept_inputs = (2 if checkpointing == "offload" else shape.layers) * tokens * h * 2
    return recompute + kept_inputs


# Common cards to estimate for on a machine without one: name -> total memory as the card reports it
# (MiB, what `torch.cuda.get_device_properties(0).total_memory` gives, a little under the marketing GB).
COMMON_GPUS_MIB: dict[str, int] = {
    "NVIDIA GeForce RTX 3060 (12 GB)": 12_288, "NVIDIA GeForce RTX 3080 (10 GB)": 10_240,
    "NVIDIA GeForce RTX 3090 (24 GB)": 24_576, "NVIDIA GeForce RTX 4060 Ti (16 GB)": 16_380,
    "NVIDIA GeForce RTX 4070 (12 GB)": 12_282, "NVIDIA GeForce RTX 4080 (16 GB)": 16_376,
    "NVIDIA GeForce RTX 4090 (24 GB)": 24_564, "NVIDIA GeForce RTX 5090 (32 GB)": 32_607,
    "NVIDIA T4 (16 GB, Colab free tier)": 15_360, "NVIDIA L4 (24 GB)": 23_034, "NVIDIA A10G (24 GB)": 23_028,
    "NVIDIA RTX A6000 (48 GB)": 49_140, "NVIDIA L40S (48 GB)": 46_068, "NVIDIA A100 (40 GB)": 40_536,
    "NVIDIA A100 (80 GB)": 81_920, "NVIDIA H100 (80 GB)": 81_559, "NVIDIA H200 (141 GB)": 143_771,
}


def common_gpu(name: str | None) -> tuple[str, int] | None:
    """(name, total bytes) of a card of COMMON_GPUS_MIB, or None for a name not in it."""
    mib = COMMON_GPUS_MIB.get(name or "")
    return None if mib is None else (str(name), mib * 2**20)


def verdict(total_bytes: int, capacity_bytes: int) -> str:
    """"fits" below 80 % of the card, "tight" up to 100 %, else "will not fit"."""
    ratio = total_bytes / max(capacity_bytes, 1)
    if ratio < FITS_BELOW:
        return "fits"
    return "tight" if ratio < TIGHT_BELOW else "will not fit"


def detect_gpu() -> tuple[str, int] | None:
    """(name, total bytes) of the first visible CUDA device, or None on a machine without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, int(props.total_memory)


def meminfo_total_bytes(text: str) -> int | None:
    """MemTotal of a /proc/meminfo text in bytes (the file's "kB" are KiB); None without one."""
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def detect_host_memory(path: str = "/proc/meminfo") -> int | None:
    """Total bytes of this machine's RAM, read from /proc/meminfo (Linux); None where it is not there.

    The machine's total, not a container's memory limit: pinned pages count against both.
    """
    try:
        with open(path) as f:
            return meminfo_total_bytes(f.read())
    except OSError:
        return None


def host_verdict(est: MemoryEstimate, ram_bytes: int | None) -> str | None:
    """verdict() of the offloaded layer inputs against the host's RAM (the GPU's thresholds: the
    OS and the loading model need RAM too); None when nothing is offloaded or the RAM is unknown."""
    if est.offload_host_ram == 0 or ram_bytes is None:
        return None
    return verdict(est.offload_host_ram, ram_bytes)
