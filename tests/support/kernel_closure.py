"""Can `torch.compile` rebuild each Triton kernel from its source? (tests/kernels/test_compile_closure.py)

Inductor (`user_defined_triton_kernel_transitive_closure_source_code`) writes a user kernel's source
and, by name, every `@triton.jit` global it calls into one generated module. It follows a helper
called by its bare name, copies int/str/bool/constexpr globals, and imports bare names from Triton.
A helper reached as `module.helper(...)` is not followed, so the rebuilt kernel dies with
`NameError`; all helpers share one namespace, so two helpers with one name, or an aliased import,
resolve to the wrong function or to nothing.

`closure_problems` walks a kernel's helpers as inductor does and names each of those. Run as a
module (`python -m tests.support.kernel_closure`, without TRITON_INTERPRET, which makes kernels
interpreted functions inductor never sees), it also has this torch's inductor write every kernel's
module and parses it, and prints {kernel: [problems]} as JSON.
"""

from __future__ import annotations

import ast
import dis
import importlib
import json
import pkgutil
import types

from triton import JITFunction
from triton.language import constexpr
from triton.runtime.interpreter import InterpretedFunction

import kestrel.kernels

JIT = (JITFunction, InterpretedFunction)  # what `triton.jit` returns, compiled or under TRITON_INTERPRET
_COPIED = (int, str, bool, constexpr)  # globals inductor writes into the rebuilt module


def kernels() -> list:
    """Every `@triton.jit` function defined in `kestrel.kernels` and its subpackages."""
    found = []
    for info in pkgutil.walk_packages(kestrel.kernels.__path__, "kestrel.kernels."):
        module = importlib.import_module(info.name)
        found += [v for v in vars(module).values() if isinstance(v, JIT) and v.fn.__module__ == module.__name__]
    return found


def name(kernel) -> str:
    return f"{kernel.fn.__module__}.{kernel.fn.__name__}"


def _global_problem(fn, symbol: str, value: object) -> str | None:
    """Why inductor cannot rebuild the bare global `symbol` that `fn` reads, or None."""
    if isinstance(value, types.ModuleType):
        if value.__name__.startswith("triton") and symbol in ("tl", "triton"):
            return None
        return f"{name(fn)} calls through module `{symbol}` ({value.__name__}): import the helper by name"
    if isinstance(value, _COPIED) or str(getattr(value, "__module__", "")).startswith("triton"):
        return None
    return f"{name(fn)} reads global `{symbol}` of type {type(value).__name__}: make it a tl.constexpr"


def closure_problems(kernel) -> list[str]:
    """What inductor's rebuild of `kernel` would get wrong, walking its helpers as inductor does."""
    problems: list[str] = []
    seen = {kernel.fn.__name__: kernel}
    stack = [kernel]
    while stack:
        fn = stack.pop()
        bare = {i.argval for i in dis.Bytecode(fn.fn) if i.opname == "LOAD_GLOBAL"}
        for symbol in fn.fn.__code__.co_names:
            value = fn.fn.__globals__.get(symbol)
            if isinstance(value, JIT):
                if value.fn.__name__ != symbol:
                    problems.append(f"`{symbol}` is an alias of {value.fn.__name__}: inductor defines the latter")
                elif symbol in seen and seen[symbol] is not value:
                    problems.append(f"two helpers named `{symbol}`: {name(value)} and {name(seen[symbol])}")
                elif symbol not in seen:
                    seen[symbol] = value
                    stack.append(value)
            elif symbol in bare and symbol in fn.fn.__globals__ and (why := _global_problem(fn, symbol, value)):
                problems.append(why)
    return problems


def inductor_source_problems(kernel) -> list[str]:
    """This torch's inductor writes the module for `kernel`; a syntax error in it, or none."""
    from torch._inductor.codegen import wrapper

    source = wrapper.user_defined_triton_kernel_transitive_closure_source_code(kernel)
    try:
        ast.parse(source)
    except SyntaxError as e:
        line = source.splitlines()[e.lineno - 1][:120] if e.lineno else ""
        return [f"inductor's module for {name(kernel)} does not parse: {e.msg} at line {e.lineno}: {line}"]
    return []


def main() -> None:
    report = {name(k): closure_problems(k) + inductor_source_problems(k) for k in kernels()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
