"""Kestrel's decode path: static KV cache, graph-captured decode step, on-device sampling,
unmerged per-row LoRA adapters, streaming text. Used by chat, the studio and GRPO rollouts.

    from kestrel.decode import Generator, SamplingParams
    gen = Generator(model, tokenizer)
    out = gen.generate([ids], max_new_tokens=128, sampling=SamplingParams(temperature=0.7, seed=0))
"""

from kestrel.decode.adapters import AdapterError, load_adapter
from kestrel.decode.chat import encode_chat, stop_token_ids
from kestrel.decode.generate import Generator
from kestrel.decode.tracking import GenerationOutput, TokenChunk
from kestrel.decode.sampling import GREEDY, SamplingParams
from kestrel.decode.stream import TextStream, stream_text

__all__ = [
    "AdapterError",
    "GREEDY",
    "GenerationOutput",
    "Generator",
    "SamplingParams",
    "TextStream",
    "TokenChunk",
    "encode_chat",
    "load_adapter",
    "stop_token_ids",
    "stream_text",
]
