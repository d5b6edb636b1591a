"""The loop every training method shares: seed, model preparation, the optimizer and its schedule,
resume, the end-of-step report and checkpoint, and saving at the end. A method (SFT, GRPO, the
preference methods) supplies its setup, which returns its run state, and its loop over steps:

    status, last_step = run_recipe(setup, train_loop, config, output_dir, callbacks)

`RunState` is what this module needs of a method's state; each method's own dataclass adds what
its steps need (batches, rollouts, a reference model). Its `evaluator` (None: no evaluation set)
carries the method's own eval batches and `Measure` (`kestrel.training.evaluation`): this loop
evaluates when due, reports eval_* metrics, keeps the best weights, stops early, and runs the
generation check at the end.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kestrel.config import TrainConfig
from kestrel.errors import TrainingDivergedError
from kestrel.model.lora import attach_lora
from kestrel.model.multimodal import freeze_outside_language_model
from kestrel.recompute.capture_stream import steps_on, steps_stream
from kestrel.recompute.checkpoint import Recompute, recompute_of, set_gradient_checkpointing
from kestrel.recompute.graph_choice import Decision
from kestrel.recompute.mlp_deferral import defer_mode, DeferDecision, MLPDeferral
from kestrel.recompute.policy import choose_checkpointing
from kestrel.training.checkpoints import latest_checkpoint, load_checkpoint, save_checkpoint, save_weights
from kestrel.training.distributed import World, shard_full_model
from kestrel.training.best import BEST_DIR
from kestrel.training.estimate import detect_host_memory, estimate_training_memory, shape_from_config, training_rows
from kestrel.training.evaluation import Evaluator
from kestrel.training.metrics import Callback, RunInfo, memory_metrics
from kestrel.training.heap import steps_heap


class RunState(Protocol):
    """What the shared loop reads and writes of a method's run state."""

    config: TrainConfig
    output_dir: Path
    model: nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    total_steps: int
    start_step: int
    device: torch.device
    world: World  # this process's rank on a run over several devices; World() on one
    evaluator: Evaluator | None


Setup = Callable[[TrainConfig, Path, Callback, World], RunState]
Loop = Callable[[Any, Callback], str]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def lr_lambda(config: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warmup, then cosine / linear decay to zero, or constant."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / (config.warmup_steps + 1)
        if config.lr_scheduler == "constant":
            return 1.0
        progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
        progress = min(1.0, progress)
        return 0.5 * (1 + math.cos(math.pi * progress)) if config.lr_scheduler == "cosine" else 1.0 - progress

    return factor


class PerformanceRecord:
    """The speed choices a run made, in `output_dir/performance.json` (rewritten whole at each):
    `gradient_checkpointing` {requested, mode, reason}, and `cuda_graphs`, one entry a decided
    batch layout (with the timings each was made from). On several devices rank 0 writes it."""

    def __init__(self, output_dir: Path, writes: bool = True) -> None:
        self.path = output_dir / "performance.json"
        self.made: dict[str, Any] = {"cuda_graphs": []}
        self.writes = writes

    def set(self, key: str, value: Any) -> None:
        self.made[key] = value
        if self.writes:
            self.path.write_text(json.dumps(self.made, indent=1) + "\n")


def graph_reporter(record: PerformanceRecord, cb: Callback) -> Callable[[Decision], None]:
    """Where a run's CUDA-graph choices go: a line in its log each, and all of them in `record`."""

    def report(decision: Decision) -> None:
        way = "on" if decision.graphed else "off"
        cb.on_log(f"CUDA graphs {way} for batches of {decision.layout}: {decision.reason}")
        record.set("cuda_graphs", [*record.made["cuda_graphs"], decision.as_metrics()])

    return report


def deferral_reporter(record: PerformanceRecord, cb: Callback) -> Callable[[DeferDecision], None]:
    """Where a run's MLP deferral choices go (`kestrel.recompute.mlp_deferral`): a log line each, all in `record`."""

    def report(decision: DeferDecision) -> None:
        way = "deferred to its backward" if decision.deferred else "whole rows"
        cb.on_log(f"recomputed MLP at {decision.rows} rows: {way} ({decision.reason})")
        record.set("defer_mlp", [*record.made.get("defer_mlp", []), decision.as_metrics()])

    return report


def attention_reporter(record: PerformanceRecord, cb: Callback) -> Callable[[int, bool, str], None]:
    """Where `keep_attention: auto`'s answers go (`Recompute.attention_keeps_up`): a log line each, all in `record`."""

    def report(rows: int, kept: bool, why: str) -> None:
        way = "kept from the first pass" if kept else "recomputed"
        cb.on_log(f"attention outputs at {rows} rows: {way} ({why})")
        record.set("keep_attention", [*record.made.get("keep_attention", []), {"rows": rows, "kept": kept, "reason": why}])

    return report


def on_cuda_device(model: nn.Module) -> bool:
    return any(p.is_cuda for p in model.parameters())


def checkpointing_for(config: TrainConfig, model: nn.Module, world: World) -> tuple[str, str]:
    """(mode, why): the config's mode, or `auto`'s choice for this run (`kestrel.recompute.policy`),
    from its device, GPU count, and what offloading would pin against this machine's RAM."""
    if config.gradient_checkpointing != "auto":
        return config.gradient_checkpointing, "set in the run's config"
    on_cuda = on_cuda_device(model)
    need = None
    if on_cuda and world.size == 1:
        method, rows = training_rows(config.method, config.preference.finetune, config.batch_size)
        try:
            shape = shape_from_config(model.config.to_dict())
        except (KeyError, TypeError, ValueError):  # a config the estimate cannot read: need unknown
            shape = None
        if shape is not None:
            need = estimate_training_memory(
                shape, method, config.lora.r, config.lora.targets, rows, config.max_seq_length, "offload",
                config.grpo.num_generations, config.grpo.max_completion_length, config.grpo.max_prompt_length,
                1, config.performance.offload_gate, config.performance.keep_attention,
                config.performance.keep_projection, config.performance.keep_qkv).offload_host_ram
    return choose_checkpointing(on_cuda, world.size, need, detect_host_memory())


def prepare_model(
    config: TrainConfig, model: nn.Module, output_dir: Path, cb: Callback, world: World | None = None
) -> tuple[nn.Module, Recompute | None]:
    """LoRA attached (or every weight unfrozen), checkpointing on, train mode; returns the model
    and the run's checkpointing (None when off). On several devices (`world`), LoRA's adapters
    start as rank 0's, and a full fine-tune is sharded with FSDP2 (its layers then run without
    CUDA graphs: a graph cannot hold FSDP's gathers)."""
    world = world or World()
    cuda_graphs = config.performance.cuda_graphs
    record = PerformanceRecord(output_dir, writes=world.is_main)
    mode, why = checkpointing_for(config, model, world)
    if config.gradient_checkpointing == "auto":
        cb.on_log(f"gradient checkpointing {mode} (auto): {why}")
    record.set("gradient_checkpointing", {"requested": config.gradient_checkpointing, "mode": mode, "reason": why})
    if config.trains_all_weights:
        for p in model.parameters():
            p.requires_grad_(True)
        freeze_outside_language_model(model)  # an image-text model's vision tower stays as it is
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        model = attach_lora(model, config.lora)
    deferral = MLPDeferral(defer_mode(config.performance.defer_mlp), on_decision=deferral_reporter(record, cb))
    recompute = set_gradient_checkpointing(
        model, mode, "off" if world.distributed and config.trains_all_weights else cuda_graphs,
        graph_reporter(record, cb), config.performance.offload_gate, deferral, config.performance.keep_attention,
        attention_reporter(record, cb), config.performance.keep_projection, config.performance.keep_qkv,
        config.performance.backward_graph_capture, config.performance.capture_stream)
    if world.distributed:
        if config.trains_all_weights:
            shard_full_model(model, decoder_layers(model), world)
            cb.on_log(f"full fine-tuning sharded with FSDP2 over {world.size} devices (CUDA graphs off)")
        else:
            world.broadcast_parameters(model)
            cb.on_log(f"data parallel over {world.size} devices: base replicated, adapter gradients summed")
    model.train()
    return model, recompute


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (Hugging Face's checkpointable layers), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def optimizer_and_resume(
    config: TrainConfig, model: nn.Module, total_steps: int, output_dir: Path, cb: Callback
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, int]:
    """AdamW over the trainable parameters and the lr schedule, restored (with the model) from the
    latest checkpoint in `output_dir` when there is one. Returns them and the step to start at."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = next(iter(params)).device.type == "cuda" if params else False
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, total_steps))
    start = 0
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is not None:
        start = load_checkpoint(checkpoint, model, optimizer, scheduler)["step"]
        cb.on_log(f"resuming from {checkpoint.name} (step {start} of {total_steps})")
    return optimizer, scheduler, start


def optimizer_step(
    s: RunState, loss: torch.Tensor | None = None, checked_later: bool = False,
) -> tuple[torch.Tensor, float]:
    """Clip the accumulated gradients (max_grad_norm; 0 = no clipping), step the optimizer and the
    schedule, clear the gradients. Returns (grad norm before clipping, the lr this step used).

    Before the weights change, the step's `loss` and the gradient norm must be finite: the first
    NaN or inf stops the run with a TrainingDivergedError naming the step and what to change,
    so it ends `failed` with the last checkpoint intact, never `completed` with a NaN model.
    By default the host reads both first (a sync). `checked_later` with a fused optimizer: the
    guard stays on the device (`guarded_step`: a non-finite step updates nothing) and the caller
    reads the values later and calls `raise_if_diverged`, so the host need not wait here."""
    params = [p for g in s.optimizer.param_groups for p in g["params"]]
    s.world.sync_gradients(p for p in params if not isinstance(p, DTensor))  # FSDP's are reduced already
    clip = s.config.max_grad_norm if s.config.max_grad_norm > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    lr = s.scheduler.get_last_lr()[0]
    if checked_later and s.optimizer.defaults.get("fused"):
        guarded_step(s.optimizer, loss, grad_norm)
    else:
        check_finite(s, loss, grad_norm)
        s.optimizer.step()
    s.scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def stage_to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`values` on their way to host memory without waiting: on CUDA a pinned copy queued on the current
    stream behind everything before it, and an event (timed) recorded after it, whose `synchronize` waits
    for that work only, not for work queued later; elsewhere `values` themselves and no event."""
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event(enable_timing=True)
    done.record()
    return host, done


def _finite_values(loss: torch.Tensor | None, grad_norm: torch.Tensor) -> torch.Tensor:
    values = [grad_norm.detach().float().reshape(())]
    if loss is not None:
        values.append(loss.detach().float().reshape(()).to(values[0].device))
    return torch.stack(values)


def guarded_step(optimizer: torch.optim.Optimizer, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> None:
    """A fused optimizer's step that updates nothing (weights, moments, step counts) unless `loss` and
    `grad_norm` are finite, decided on the device: torch's fused Adam/AdamW skip a step whose
    `found_inf` (the attribute GradScaler sets) is non-zero."""
    optimizer.found_inf = (~torch.isfinite(_finite_values(loss, grad_norm))).any().float()
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def check_finite(s: RunState, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> None:
    """Raise TrainingDivergedError when the loss or the gradient norm is NaN or infinite (one
    host read of both)."""
    values = _finite_values(loss, grad_norm)
    if bool(torch.isfinite(values).all()):
        return
    s.optimizer.zero_grad(set_to_none=True)
    raise_if_diverged(s, s.scheduler.last_epoch + 1, float(values[1]) if loss is not None else None, float(values[0]))


def raise_if_diverged(s: RunState, step: int, loss: float | None, grad_norm: float) -> None:
    """TrainingDivergedError for step `step` (1-based) when its loss or gradient norm, read on the host, is
    not finite."""
    if math.isfinite(grad_norm) and (loss is None or math.isfinite(loss)):
        return
    raise TrainingDivergedError(divergence_message(s.config, step, loss, grad_norm))


def divergence_message(config: TrainConfig, step: int, loss: float | None, grad_norm: float) -> str:
    """Why a run stopped on a non-finite loss or gradient, and what to change."""
    seen = ([f"the loss is {loss:g}"] if loss is not None else []) + [f"the gradient norm is {grad_norm:g}"]
    causes = [f"lower learning_rate (now {config.learning_rate:g})",
              f"check weight_decay (now {config.weight_decay:g})",
              f"keep max_grad_norm on (now {config.max_grad_norm:g}; 0 turns clipping off)"]
    if config.method == "grpo":
        causes.append(f"check grpo.beta (now {config.grpo.beta:g}) and the reward weights")
    if config.dtype == "fp16":
        causes.append("use dtype bf16 or fp32 (fp16 overflows easily)")
    return (f"training stopped at step {step}: {' and '.join(seen)}, not a finite number, so the model "
            f"would turn to NaN. The weights were not updated at this step; {'; '.join(causes)}.")


def graph_metrics(recompute: Recompute | None) -> dict[str, float]:
    """`cuda_graphs`: 1 when the step's last forward ran as CUDA graphs, else 0 (with checkpointing)."""
    return {} if recompute is None else {"cuda_graphs": float(recompute.graphed)}


def step_end(device: torch.device) -> float:
    """`time.perf_counter()` once `device` has run the step's queued work (CUDA runs it
    asynchronously: without the wait a step's time would be its launch time)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def report_step(s: RunState, cb: Callback, step: int, metrics: dict[str, float], tokens: float,
                started: float, t0: float, now: float) -> str | None:
    """End step `step` (0-based) of a loop that began at `started`: the step began at `t0` and its
    work was done at `now` (`step_end`). Reports the method's `metrics` with the ones every method
    shares (step, total_steps, tokens_per_s of the step's `tokens`, memory, elapsed_s, eta_s), then
    `end_of_step`; returns the final status when the run ends here."""
    done, elapsed = step + 1, now - started
    memory = memory_metrics(s.device)
    if s.evaluator is not None:
        s.evaluator.schedule.stepped(now - t0)
    return end_of_step(s, cb, done, {
        "step": done, "total_steps": s.total_steps, **metrics, "tokens_per_s": tokens / max(now - t0, 1e-9),
        **memory, **s.world.per_device(memory), "elapsed_s": elapsed,
        "eta_s": elapsed / (done - s.start_step) * (s.total_steps - done),
    })


def end_of_step(s: RunState, cb: Callback, done: int, metrics: dict[str, float]) -> str | None:
    """Report the step, checkpoint when due or asked to stop, and return the final status
    (cancelled / interrupted) when the run must end here."""
    if done % s.config.logging_steps == 0 or done == s.total_steps:
        cb.on_step(metrics)
    early = evaluate_if_due(s, cb, done)
    stop = s.world.agree_stop(cb.should_stop())
    if stop or (s.config.save_steps and done % s.config.save_steps == 0 and done < s.total_steps):
        path = save_checkpoint(s.output_dir, done, s.model, s.optimizer, s.scheduler, {"total_steps": s.total_steps},
                               s.world)
        if s.world.is_main:
            cb.on_checkpoint(done, str(path))
    if stop:
        return "cancelled" if stop == "cancel" else "interrupted"
    return "completed" if early else None


def evaluate_if_due(s: RunState, cb: Callback, done: int) -> bool:
    """Evaluate when the interval or the last step says so; report eval_* at step `done`, keep
    the best weights. Returns True when early stopping ends the run before its last step."""
    ev = s.evaluator
    if ev is None or not ev.due(done, s.total_steps):
        return False
    t0 = time.perf_counter()
    metrics = ev.evaluate(s.model, s.world)
    cb.on_step({"step": done, **metrics})
    stop = ev.record(done, metrics, s.model, s.tokenizer, cb.on_log, s.world)
    # A full model's best is written by now; an adapter's write is reported once done (a new save
    # waits for the one before, so that one is reported here), the last one at the run's end.
    report_best(s, cb, wait=False)
    replanned = ev.schedule.evaluated(done, s.total_steps, time.perf_counter() - t0, s.world)
    if replanned and s.world.is_main:
        cb.on_log(replanned)
    return stop and done < s.total_steps


def report_best(s: RunState, cb: Callback, wait: bool) -> None:
    """`on_best` for best weights whose write has completed (`BestWrites.written`); with `wait`
    (the end of the run), after the write in flight is done. Raises a failed write's error."""
    step = s.evaluator.best_writes.written(wait) if s.evaluator is not None else None
    if step is not None and s.world.is_main:
        cb.on_best(step, str(s.output_dir / BEST_DIR))


def generation_check(s: RunState, cb: Callback, step: int) -> None:
    """The end-of-run generation check, when the method has held-out prompts; a model the
    decode path lacks only skips it (said in the log)."""
    from kestrel.decode.model import UnsupportedModelError
    from kestrel.training.generation_check import GENERATION_FILE

    check = s.evaluator.generation if s.evaluator is not None else None
    if check is None or not check.cases or not s.world.is_main:  # rank 0 decodes alone; the others are done
        return
    if any(isinstance(p, DTensor) for p in s.model.parameters()):
        cb.on_log(f"generation check skipped: the model is sharded over {s.world.size} devices (FSDP2), and the "
                  "decode path runs one whole copy; run it on the saved model with `python -m kestrel chat`")
        return
    free_training_memory(s)
    try:
        summary = check.run(s.model, s.tokenizer, s.output_dir, step, seconds=s.evaluator.schedule.check_seconds())
    except UnsupportedModelError as exc:
        cb.on_log(f"generation check skipped: the fast decode path does not run this model ({exc})")
        return
    except torch.OutOfMemoryError:
        summary = None
    if summary is None:  # out of memory. The weights are saved and the run is complete: only the check is lost.
        free_training_memory(s)  # here, not in the except block, whose traceback still holds the check's tensors
        cb.on_log(f"generation check skipped: the GPU ran out of memory decoding {len(check.cases)} held-out "
                  "prompts after training (the decode path's cache and buffers come on top of the model). "
                  f"The trained weights are saved; check them once the GPU is free: {check_later(s, step)}")
        return
    cb.on_step({"step": step, "eval_exact_match": summary["exact_match"], "eval_rouge_l": summary["rouge_l"]})
    cb.on_log(f"generation check on {len(check.cases)} held-out prompts: exact match {summary['exact_match']:.0%}, "
              f"ROUGE-L {summary['rouge_l']:.3f} (in {s.output_dir / GENERATION_FILE})")
    if summary["stopped_early"]:
        cb.on_log(f"generation check: {summary['stopped_early']} of {len(check.cases)} answers stopped at its time "
                  f"budget of {summary['seconds']:.1f} s, so their scores read low; the budget keeps evaluation "
                  f"within {s.evaluator.schedule.budget:.0%} of the training time. For full answers: "
                  f"{check_later(s, step)}")


def check_later(s: RunState, step: int) -> str:
    """How to run the generation check on the saved final weights, whole and without a time budget."""
    return (f"the Runs tab's 'Check generations', or `python -m kestrel.training.check_run {s.output_dir} "
            f"--weights {s.output_dir} --step {step}`")


def free_training_memory(s: RunState) -> None:
    """After the last step and the final save, the optimizer's state, the gradients and the
    training's CUDA graphs (their static buffers and pools) are not needed again: freed before
    the generation check decodes, so its cache and buffers take their place rather than adding
    to the run's memory peak (they did: 8B QLoRA DPO, bench/RESULTS.md)."""
    s.optimizer.zero_grad(set_to_none=True)
    s.optimizer.state.clear()
    recompute = getattr(s, "recompute", None)  # a method without checkpointing has none
    if recompute is not None:
        recompute.release()  # empties the allocator's cache too
    elif torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_recipe(
    setup_fn: Setup, loop_fn: Loop, config: TrainConfig, output_dir: Path, cb: Callback, world: World | None = None
) -> tuple[str, int]:
    """Set up, train and save; returns (status, last step). On several devices every rank runs
    this; rank 0 alone writes (the collectives inside the saves need every rank)."""
    s = setup_fn(config, output_dir, cb, world or World())
    cb.on_start(RunInfo(str(output_dir), s.total_steps, s.start_step, str(s.device), config.method))
    recompute = recompute_of(s.model)
    stream = steps_stream(s.device, recompute.capture_stream) if recompute is not None else None
    if stream is not None:
        cb.on_log("the steps run on a stream of their own, and the layer graphs capture on it "
                  "(performance.capture_stream: steps)")
    # no full garbage collection walks the libraries and the model between steps
    with steps_heap(), steps_on(stream):
        status = loop_fn(s, cb) if s.start_step < s.total_steps else "completed"
    report_best(s, cb, wait=True)  # the last best weights are on disk before the run ends
    last = s.scheduler.last_epoch  # steps done: below total_steps when stopped (or stopped early)
    if status == "completed":
        path = save_weights(s.model, output_dir, s.tokenizer, s.world)
        cb.on_log(f"saved {path}")
        if s.start_step < s.total_steps:
            generation_check(s, cb, last)
    return status, last
