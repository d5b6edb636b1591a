"""Which checkpointing a run gets when its config says `gradient_checkpointing: auto` (the default).

    mode, why = choose_checkpointing(on_cuda, devices, host_need, host_ram)

The rule, in order (no torch here: the studio's memory estimate applies it before anything loads):
- no CUDA device: `standard`. Offloading pages activations out of GPU memory; on the CPU there is
  none to save.
- several GPUs: `standard`. Every rank pages its activations through the one host at once and they
  share its memory bandwidth: offload scaled 0.86 from one to four GPUs where standard scaled 0.99
  (bench/RESULTS.md, "One run on several GPUs").
- one GPU: `offload` where the pages it pins (`host_need`: the layer inputs and the MLP gate
  products, `kestrel.training.estimate`) fit this machine's RAM with the estimate's margin
  (`verdict` "fits"); `standard` where they may not, or where the RAM or the need is unknown.
  On one GPU offload holds less GPU memory than standard (the layer inputs live in host memory),
  and its recompute skips the MLP's gate product, which it pages back in; the copies run on a
  side stream beside the compute. That is the configuration every single-GPU figure of
  bench/RESULTS.md since session 12 measured against Unsloth, TRL and HF.
A mode named in the config (`off`, `standard`, `offload`) is used as it is.
"""

from __future__ import annotations

from kestrel.training.estimate import GIB, verdict


def choose_checkpointing(on_cuda: bool, devices: int, host_need: int | None,
                         host_ram: int | None) -> tuple[str, str]:
    """(mode, why) for `auto`; see the module docstring. `host_need`: bytes offload would pin."""
    if not on_cuda:
        return "standard", "no CUDA device (offloading saves GPU memory only)"
    if devices > 1:
        return "standard", (f"{devices} GPUs: offloading ranks would share the host's memory bandwidth "
                            "(standard checkpointing scales better)")
    if host_need is None or host_ram is None:
        unknown = "what offloading would pin" if host_need is None else "this machine's RAM"
        return "standard", f"one GPU, but {unknown} is unknown (offloaded pages must fit in RAM)"
    need = f"{host_need / GIB:.1f} GiB of this machine's {host_ram / GIB:.1f} GiB RAM"
    if verdict(host_need, host_ram) != "fits":
        return "standard", f"one GPU, but offloading would pin {need}, too much to leave the rest room"
    return "offload", (f"one GPU: layer inputs and MLP gate products paged to host memory ({need}); "
                       "less GPU memory, and the recompute skips the gate product")
