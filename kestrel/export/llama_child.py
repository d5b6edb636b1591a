"""Every llama.cpp call of the export, each in a child process.

llama.cpp is C++ reached through ctypes: a vocabulary it cannot read (a byte-level BPE tokenizer
that also claims byte fallback, say) makes it throw an exception nothing catches, and the
process aborts (SIGABRT, exit 134) with no Python error and no message. In the command line that
ends the export; in a job it takes the worker with it. So the export never calls llama.cpp in its
own process: `run_in_child(stage, fn, *args)` runs one of the functions below in a fresh
`python -m kestrel.export.llama_child` and returns its result. An exception raised there is raised
here; a crash (a signal, an abort) becomes a `LlamaCrashError` naming the stage, and the export
stops with its staging folder removed, as on any error.

The child is a new interpreter, not a fork: the exporting process may hold CUDA and threads. It
imports only this module (no torch), numpy and llama_cpp, so a call costs about a third of a
second more than before; each check does all its llama.cpp work in one call. The child shares
the parent's process group, so stopping a job stops it too, and it exits when the parent dies
(its pipe closes). Results (token ids, logits, text) come back pickled over a pipe.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kestrel.constants import signal_name
from kestrel.errors import KestrelError

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding `kestrel/`, for the child's import


class LlamaCrashError(KestrelError):
    """llama.cpp ended its process (an abort, a signal) during an export stage."""


def _how(returncode: int) -> str:
    name = signal_name(returncode)
    return f"exit code {returncode}" if name is None else f"killed by {name}, exit code {128 - returncode}"


def crash_message(stage: str, returncode: int) -> str:
    """What a crashed llama.cpp call says: the stage, how the process ended, what it means."""
    return (f"llama.cpp crashed while {stage} ({_how(returncode)}), without an error message; "
            "the export stopped and removed its files. llama.cpp aborts like this on input it cannot handle, "
            "most often a tokenizer whose files contradict each other; the log above may show its last words")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GGML_NO_BACKTRACE", "1")  # on an abort ggml would attach gdb and print pages of frames
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_in_child(stage: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a fresh child process; `fn` is a module-level function of a module the child
    can import without torch (this one). Its exception is raised here; the child's crash raises
    LlamaCrashError(crash_message(stage, ...))."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kestrel.export.llama_child", str(to_child_r), str(from_child_w)],
                                pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, env=_child_env())
    except OSError:
        os.close(to_child_w)
        os.close(from_child_r)
        raise
    finally:
        os.close(to_child_r)
        os.close(from_child_w)
    try:
        with Connection(to_child_w, readable=False) as out, Connection(from_child_r, writable=False) as back:
            out.send((fn.__module__, fn.__qualname__, args))
            kind, value = back.recv()
    except (EOFError, OSError):  # the child is gone without answering
        raise LlamaCrashError(crash_message(stage, proc.wait())) from None
    except BaseException:  # interrupted here: the child must not outlive the call
        proc.kill()
        proc.wait()
        raise
    proc.wait()
    if kind == "error":
        raise value
    return value


def _serve(read_fd: int, write_fd: int) -> None:
    """The child's side: one call in, its result or exception out."""
    with Connection(read_fd, writable=False) as inp, Connection(write_fd, readable=False) as out:
        module, name, args = inp.recv()
        try:
            reply: tuple[str, Any] = ("ok", getattr(importlib.import_module(module), name)(*args))
        except Exception as exc:  # noqa: BLE001 - sent to the parent, which raises it
            reply = ("error", exc)
        try:
            out.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError):
            out.send(("error", KestrelError(f"{type(reply[1]).__name__}: {reply[1]}")))


# ---------------------------------------------------------------------------------------------
# The llama.cpp calls (run in the child)


def _quiet() -> None:
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)


def _load(path: Path, **kwargs: Any) -> Any:
    import llama_cpp

    _quiet()
    return llama_cpp.Llama(str(path), verbose=False, n_threads=os.cpu_count() or 1, **kwargs)


class VocabModel:
    """A GGUF file loaded vocabulary-only by llama.cpp (no weights, no context)."""

    def __init__(self, path: Path) -> None:
        import llama_cpp
        from llama_cpp._internals import LlamaModel

        _quiet()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = LlamaModel(path_model=str(path), params=params, verbose=False)

    def __enter__(self) -> Any:
        return self.model

    def __exit__(self, *exc: Any) -> None:
        self.model.close()


def tokenize(path: Path, items: list[tuple[str, bool]]) -> list[list[int]]:
    """llama.cpp's token ids for each (text, add BOS and parse special tokens as a tokenizer adds
    them) of `items`, with `path`'s vocabulary."""
    with VocabModel(path) as vocab:
        return [vocab.tokenize(text.encode(), add_bos=add, special=True) for text, add in items]


def evaluate(path: Path, seqs: list[list[int]], n_ctx: int, sample_from: int) -> tuple[list[Any], str]:
    """Logits at every position of each sequence (one batch each, from an empty cache), and the
    decoded top-1 tokens of the first sequence from position `sample_from` on."""
    import numpy as np

    llm = _load(path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True)
    try:
        scores, sample = [], ""
        for i, seq in enumerate(seqs):
            llm.reset()
            llm.eval(seq)
            scores.append(np.asarray(llm.scores[: len(seq)], dtype=np.float32).copy())
            if i == 0 and np.isfinite(scores[0]).all():
                top = scores[0].argmax(-1)[sample_from:]
                sample = llm.detokenize([int(t) for t in top]).decode("utf-8", "replace")
        return scores, sample
    finally:
        llm.close()


def _render_builtin(model: Any, messages: list[dict[str, str]]) -> str | None:
    """The prompt llama.cpp's built-in template code writes for the GGUF's template (None: unknown)."""
    import llama_cpp

    template = llama_cpp.llama_model_chat_template(model, None)
    chat = (llama_cpp.llama_chat_message * len(messages))(
        *[llama_cpp.llama_chat_message(role=m["role"].encode(), content=m["content"].encode()) for m in messages]
    )
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(template, chat, len(messages), True, buf, len(buf))
    return buf.raw[:n].decode("utf-8") if n >= 0 else None


def chat_template(path: Path, messages: list[dict[str, str]]) -> tuple[str | None, str | None]:
    """The chat template embedded in `path` (None: none) and `messages` rendered by llama.cpp's
    built-in template code (None: a template it does not know)."""
    import llama_cpp

    with VocabModel(path) as vocab:
        embedded = llama_cpp.llama_model_chat_template(vocab.model, None)
        if not embedded:
            return None, None
        return embedded.decode(), _render_builtin(vocab.model, messages)


def encode_image(model_path: Path, mmproj_path: Path, rgb: bytes, size: tuple[int, int]) -> Any:
    """llama.cpp's multimodal library (mtmd, as llama-mtmd-cli and llama-server use it) loads
    `mmproj_path` as the projector of the language model in `model_path` and encodes one image
    (`rgb`: width x height x 3 bytes, row-major); returns its embeddings (n_tokens, n_embd) fp32,
    or None when the projector file does not load."""
    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd
    import numpy as np

    llm = _load(model_path, n_ctx=64)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.print_timings = False, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj_path).encode(), llm.model, params)
    if not ctx:
        llm.close()
        return None
    bitmap = mtmd.mtmd_bitmap_init(size[0], size[1], (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb))
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        marker = mtmd.mtmd_default_marker()
        text = mtmd.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=True)
        if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
            raise RuntimeError("mtmd could not tokenize an image prompt")
        image = next(c for c in (mtmd.mtmd_input_chunks_get(chunks, i) for i in range(mtmd.mtmd_input_chunks_size(chunks)))
                     if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE)
        if mtmd.mtmd_encode_chunk(ctx, image) != 0:
            raise RuntimeError("mtmd could not encode the image")
        n_tokens, n_embd = mtmd.mtmd_input_chunk_get_n_tokens(image), llama_cpp.llama_model_n_embd(llm.model)
        out = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n_tokens * n_embd,))
        return out.reshape(n_tokens, n_embd).copy()
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_free(ctx)
        llm.close()


def quantize_file(src: Path, dst: Path, ftype_name: str, threads: int) -> int:
    """llama.cpp's `llama_model_quantize` of `src` into `dst` as `ftype_name` (a llama_ftype
    constant's name); its return code (0: done)."""
    import llama_cpp

    _quiet()  # llama.cpp logs every tensor at INFO through llama-cpp-python's logger
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    params.nthread = threads
    return int(llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not all(a.isdigit() for a in args):
        print("usage: python -m kestrel.export.llama_child READ_FD WRITE_FD (started by the export)", file=sys.stderr)
        return 2
    _serve(int(args[0]), int(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
