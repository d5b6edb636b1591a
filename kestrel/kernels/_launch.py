"""Launching a Triton kernel with less host work per call.

`kernel[grid](*args)` re-binds and re-specialises every argument on each call (Python-side
signature binding, a specialisation per argument, a cache-key hash), more host time than many of
these kernels take on the GPU, and a QLoRA step makes about a thousand Triton launches, so the
GPU sat idle waiting for them (bench/RESULTS.md, QLoRA "Session 5"). `launch` does the first
call of each specialisation through Triton, keeps the compiled kernel it returns, and afterwards
calls that kernel's launcher directly.

The cache key is a superset of what Triton specialises on, so a cached kernel is only reused
where Triton itself would have picked it: per tensor its dtype and whether its address is
16-byte aligned (Triton's divisibility specialisation), every other argument by exact type and
value, the launch options, and the current device. Arguments must be passed positionally, all
of the kernel's parameters (constexprs included) in its order; anything else takes Triton's
own path every time. Interpreted kernels (TRITON_INTERPRET=1) return no compiled kernel and so
always take Triton's path.
"""

from __future__ import annotations

from typing import Any

import torch
from triton import knobs
from triton.runtime import driver

_MAX_ENTRIES = 1024  # per kernel; exact integer values (token counts) can vary from call to call
_CACHES: dict[int, tuple[Any, dict[tuple, Any]]] = {}


def _spec(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return type(arg), arg  # type too: 1, 1.0 and True are equal as dict keys
    raise TypeError


def _fast_path_ok(kernel: Any, args: tuple, compiled: Any) -> bool:
    params = getattr(kernel, "params", None)
    return compiled is not None and hasattr(compiled, "run") and params is not None and len(params) == len(args)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **options: Any) -> None:
    """kernel[grid](*args, **options), through the compiled kernel directly once it is known."""
    entry = _CACHES.get(id(kernel))
    if entry is None or entry[0] is not kernel:
        entry = _CACHES[id(kernel)] = (kernel, {})
    cache = entry[1]
    try:
        device = driver.active.get_current_device()
        key = (device, tuple(options.items()), *map(_spec, args))
    except Exception:  # an argument we do not key on, or no active GPU driver (interpreter)
        kernel[grid](*args, **options)
        return
    compiled = cache.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **options)
        if _fast_path_ok(kernel, args, compiled):
            if len(cache) >= _MAX_ENTRIES:
                cache.clear()
            cache[key] = compiled
        return
    stream = driver.active.get_current_stream(device)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    meta = None if enter is None else compiled.launch_metadata(grid, stream, *args)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, meta, enter, leave, *args)


def clear() -> None:
    """Forget every cached compiled kernel (tests; after changing Triton knobs)."""
    _CACHES.clear()
