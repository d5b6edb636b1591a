"""What a CUDA-graphed decoder layer's static inputs are made from (`kestrel.recompute.layer_graphs`): a
call's arguments described as a hashable signature (tensors by shape and dtype, the rest by
value), the same arguments with their tensors swapped for static copies, and the static input
buffers shared by every layer, which copy only what they do not already hold."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import weakref
from typing import Any, Callable

import torch
from torch import nn

_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)


class NotGraphable(Exception):
    """The call has something a replay cannot reproduce; it runs eagerly."""


def signature(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """A hashable description of `obj` (tensors by shape and dtype, everything else by value);
    its tensors are appended to `leaves` in order. Raises NotGraphable for what a static copy
    cannot stand for: a tensor off CUDA, not contiguous or requiring grad; an unknown object."""
    if isinstance(obj, torch.Tensor):
        if not obj.is_cuda or not obj.is_contiguous() or obj.requires_grad:
            raise NotGraphable("a layer argument is a CPU, strided or grad-requiring tensor")
        leaves.append(obj)
        return ("T", tuple(obj.shape), obj.dtype, obj.device)
    if isinstance(obj, _SCALARS):
        return (type(obj), obj)
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(signature(o, leaves) for o in obj))
    if isinstance(obj, dict):
        return (dict, tuple((k, signature(v, leaves)) for k, v in obj.items()))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), tuple(signature(getattr(obj, f.name), leaves) for f in dataclasses.fields(obj)))
    if callable(obj) and hasattr(obj, "__qualname__"):
        return ("F", obj)  # a function (an attention kernel): by identity
    raise NotGraphable(f"a layer argument of type {type(obj).__name__}")


def substitute(obj: Any, tensors: Any) -> Any:
    """`obj` with its tensors replaced, in `signature`'s order, by those `tensors` yields."""
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(substitute(o, tensors) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(substitute(o, tensors) for o in obj)
    if isinstance(obj, dict):
        return {k: substitute(v, tensors) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, substitute(getattr(obj, f.name), tensors))
        return out
    return obj


class StaticBuffers:
    """The static input buffers of one device, shared by every layer's graphs: one storage per
    slot and dtype, which each shape of that slot views from its start (a run's batch layouts
    share it; it grows to the largest). Each storage remembers which tensor's values it holds
    (weakly, with its version and shape), so feeding it that tensor again copies nothing.

    A storage that grows is replaced, and `on_replace(old)` is told: the graphs captured on the old
    one still hold it, so unless they are dropped (`GraphRegistry` drops them; their signatures
    capture again, on the new storage, at their next sighting) every size a run's layouts grew
    through would stay allocated, the sum of them rather than the largest.

    `sizes` ((slot, dtype, device) -> elements): what the buffers before these were asked for (`asked`) before
    their graphs were dropped (`GraphRegistry.release`). A slot's storage is made at least that large at once,
    so the layouts graphed again do not grow it through their sizes once more, each growth dropping the graphs
    captured meanwhile. Only what was asked since the drop before: a large layout since decided eager, and so
    no longer captured, stops holding memory one drop later."""

    def __init__(
        self, on_replace: Callable[[torch.Tensor], None] | None = None, sizes: dict[tuple, int] | None = None,
    ) -> None:
        self.storage: dict[tuple, torch.Tensor] = {}  # (slot, dtype, device) -> flat buffer
        self.sizes = dict(sizes or {})
        self.asked: dict[tuple, int] = {}  # (slot, dtype, device) -> the most elements `get` was asked for
        self.views: dict[tuple, torch.Tensor] = {}  # (slot, shape, dtype, device) -> view of it
        # data_ptr -> (tensor, version, shape, stride): a slot's views of one storage differ in shape or layout
        self.holds: dict[int, tuple[weakref.ref, int, tuple[int, ...], tuple[int, ...]]] = {}
        self.copies = 0  # copies made (tests and profiling read it)
        self.replaced = 0  # storages replaced by larger ones
        self.on_replace = on_replace

    def get(self, slot: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (slot, tuple(shape), dtype, device)
        view = self.views.get(key)
        if view is not None:
            return view
        numel = 1
        for n in shape:
            numel *= n
        base_key = (slot, dtype, device)
        self.asked[base_key] = max(numel, self.asked.get(base_key, 0))
        base = self.storage.get(base_key)
        if base is None or base.numel() < numel:
            old = base
            size = max(numel, self.sizes.pop(base_key, 0))
            base = self.storage[base_key] = torch.empty(size, dtype=dtype, device=device)
            self.views = {k: v for k, v in self.views.items() if k[0] != slot or k[2] != dtype or k[3] != device}
            if old is not None:
                self._replace(old)
        view = self.views[key] = base[:numel].view(shape)
        return view

    def _replace(self, old: torch.Tensor) -> None:
        """Forget what `old`'s addresses held (freed, they may come back as another buffer that
        holds nothing yet) and tell `on_replace`."""
        start, end = old.data_ptr(), old.data_ptr() + old.numel() * old.element_size()
        self.holds = {ptr: held for ptr, held in self.holds.items() if not start <= ptr < end}
        self.replaced += 1
        if self.on_replace is not None:
            self.on_replace(old)

    def like(self, slot: Any, t: torch.Tensor) -> torch.Tensor:
        return self.get(slot, tuple(t.shape), t.dtype, t.device)

    def get_strided(
        self, slot: Any, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: torch.device,
    ) -> torch.Tensor:
        """A buffer of `shape` laid out with `stride`'s order of dimensions when that order is a
        dense layout (a transposed K/V (B, H, T, D) view of (B, T, H, D) keeps its strides, so the
        kernels reading it see what they see eagerly); contiguous otherwise (a slice): `dense_view`."""
        return dense_view(self.get(slot, (math.prod(shape),), dtype, device), tuple(shape), tuple(stride))

    def feed(self, buf: torch.Tensor, t: torch.Tensor) -> None:
        held = self.holds.get(buf.data_ptr())
        if held is None or held[0]() is not t or held[1:] != (t._version, tuple(buf.shape), buf.stride()):
            buf.copy_(t)
            self.copies += 1
            self.hold(buf, t)

    def hold(self, buf: torch.Tensor, t: torch.Tensor) -> None:
        """Record that `buf` now holds `t`'s values."""
        self.holds[buf.data_ptr()] = (weakref.ref(t), t._version, tuple(buf.shape), buf.stride())

    def forget(self, buf: torch.Tensor) -> None:
        self.holds.pop(buf.data_ptr(), None)


def dense_view(flat: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """`flat`'s first prod(shape) elements as a tensor of `shape` whose dimensions lie in memory in the order
    `stride` gives them, where that is a dense layout (a permutation of a contiguous one, as attention's output
    O (B, H, S, D) over (B, S, H, D) memory; a dimension of size one may differ in stride, which says nothing
    about the layout); contiguous otherwise (a slice, a broadcast). A copy between two tensors of one dense
    layout is one flat copy, and a kernel that wants that layout lays nothing out again."""
    order = sorted(range(len(shape)), key=lambda d: stride[d], reverse=True)
    flat = flat[:math.prod(shape)]
    view = flat.view([shape[d] for d in order]).permute(sorted(range(len(shape)), key=order.__getitem__))
    same = all(view.stride(d) == stride[d] for d in range(len(shape)) if shape[d] > 1)
    return view if same else flat.view(shape)


def graphable(run: Callable[..., torch.Tensor], hidden: torch.Tensor, training: bool = True) -> bool:
    """Whether a checkpoint's call can run as a `GraphedLayer`: CUDA, a training forward (or, with
    `training` False, a no-grad one: `kestrel.recompute.no_grad`), `run` a layer's bound call."""
    layer = getattr(run.func, "__self__", None) if isinstance(run, functools.partial) else None
    return (
        isinstance(layer, nn.Module)
        and not run.args
        and hidden.is_cuda
        and hidden.is_contiguous()
        and torch.is_grad_enabled() == training
        and not torch.cuda.is_current_stream_capturing()
    )
