"""Answer log-probs of many (prompt, answer) rows in one forward, through the chunked fused
log-prob path: `(rows, length, vocab)` logits never exist.

    rows = answer_rows([(prompt_ids, answer_ids), ...], pad_id, device, flat=runs_varlen(model))
    logp = answer_logprobs(model, rows)              # (R, L) fp32, 0 past each answer
    seq = logp.sum(-1); tokens = rows.tokens         # (R,) sequence log-probs and answer lengths

Paired methods put the chosen rows first and the rejected rows after them (concatenated along
the batch), so one forward of the decoder stack scores both. Three layouts, as SFT batches (widths
rounded up by `bucket_width`):

    padded  (R, T) right-padded rows; plain causal attention is exact for every real token
    flat    (1, sum of lengths) one padding-free row, `position_ids` restarting at 0 for each
            (prompt, answer), for models whose patched attention runs variable-length kernels
    shared  (1, sum of P + C + R) one padding-free row of groups [prompt, chosen, rejected]: the
            prompt computed once (`shared_answer_rows`); the rejected answer's positions restart
            at |P| and its queries see the prompt's keys and its own, never the chosen answer's
            (`kestrel.model.attention.ForkedSamples`). Both answers' first tokens are predicted
            by the prompt's last state.

Only a forward with gradients (the policy's, which the CUDA-graph chooser sees) runs the rounded
width; a no-gradient forward (the reference, KTO's KL rows, evaluation) runs the real columns
alone (`AnswerRows.used`): the padding would be computed through every layer for nothing. The
exception is a reference pass of a run that graphs its layouts (`kestrel.recompute.no_grad`): it
runs the rounded width too, so that its layers replay graphs of the policy's shapes.

Either way the hidden state just before each answer token is gathered at its (row, column), the N
real answer tokens of all rows and no padding (`(N, H)`: rows' answers differ in length, and a
padded `(R, L)` grid would send every short answer's padding through the LM head too), and
`kernels.chunked_token_logprobs` projects it a chunk of tokens at a time:
logp_n = log_softmax(cap(h[idx_n] @ W^T))[y_n], placed at (r, j) of the `(R, L)` result (0 past
each answer's end). Chunk logits are never kept (kestrel/kernels/cross_entropy.py), so this
step's memory is the hidden states'.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kestrel import kernels
from kestrel.data.collate import bucket_width
from kestrel.model.attention import FORK_KWARG, STARTS_KWARG, ForkedSamples, HostStarts, fork_layout, host_starts
from kestrel.model.registry import logit_softcap
from kestrel.recompute.no_grad import replays_training_shapes
from kestrel.training.grpo.logprobs import causal_lm

Group = tuple[list[int], list[list[int]]]  # (prompt ids, [answer ids, ...]) that share the prompt

@dataclass
class AnswerRows:
    input_ids: torch.Tensor  # (B, T): B = R padded, or 1 flat
    position_ids: torch.Tensor | None  # (1, T) flat layout only
    row: torch.Tensor  # (N,) row in (B, T) of the hidden state predicting each answer token
    col: torch.Tensor  # (N,) its column
    used: int  # columns holding real tokens (flat: all rows' tokens; padded: the longest row)
    targets: torch.Tensor  # (N,) the answer tokens, row after row
    slots: torch.Tensor  # (N,) where each goes in the (R, L) result: r * L + j
    shape: tuple[int, int]  # (R, L): rows, longest answer
    tokens: torch.Tensor  # (R,) answer lengths
    real_tokens: int  # prompt + answer tokens of all rows (no padding; a shared prompt counted with each answer)
    # Shared layout: the model forward's `ForkedSamples` for the rounded width (a forward with
    # gradients) and for the real columns (`used`, without); None for the other layouts.
    forks: tuple[ForkedSamples, ForkedSamples] | None = None
    # Flat rows: where their samples start, read on the host (the forward then does not sync on it)
    starts: HostStarts | None = None


def answer_rows(pairs: list[tuple[list[int], list[int]]], pad_id: int, device: torch.device, flat: bool) -> AnswerRows:
    """(prompt ids, answer ids) rows -> the tensors of one forward (see the module docstring)."""
    rows, length = len(pairs), max(len(a) for _, a in pairs)
    lengths = [len(p) + len(a) for p, a in pairs]
    # Widths rounded up as SFT's batches are (at most 1/8 more), so the shapes of a run's forwards
    # repeat and its per-layout choices (CUDA graphs) are made once per bucket.
    width = bucket_width(sum(lengths) if flat else max(lengths))
    ids = torch.full((1 if flat else rows, width), pad_id, dtype=torch.long)
    positions = torch.zeros((1, width), dtype=torch.long) if flat else None
    answers = [len(a) for _, a in pairs]
    row_of, col_of, slots = (torch.empty(sum(answers), dtype=torch.long) for _ in range(3))
    at = done = 0
    for r, (p, a) in enumerate(pairs):
        n = len(p) + len(a)
        row = 0 if flat else r
        col = at if flat else 0  # the row's first token
        ids[row, col : col + n] = torch.tensor(p + a, dtype=torch.long)
        if positions is not None:
            positions[0, at : at + n] = torch.arange(n)
        # token j of the answer sits at column col + len(p) + j; the state before it predicts it
        row_of[done : done + len(a)] = row
        col_of[done : done + len(a)] = col + len(p) - 1 + torch.arange(len(a))
        slots[done : done + len(a)] = r * length + torch.arange(len(a))
        done += len(a)
        at += n if flat else 0
    if positions is not None:
        positions[0, at:] = torch.arange(width - at)  # the padding tail is one more "sequence"
    targets = torch.tensor([t for _, a in pairs for t in a], dtype=torch.long)
    move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    return AnswerRows(move(ids), move(positions), move(row_of), move(col_of), sum(lengths) if flat else max(lengths),
                      move(targets), move(slots), (rows, length), move(torch.tensor(answers, dtype=torch.long)),
                      sum(lengths), starts=None if positions is None else host_starts(None, positions, 1))


def shared_widths(real: int, keys: int) -> tuple[int, int]:
    """(row width, key width) of a shared forward with gradients over `real` tokens whose key side
    holds `keys` rows: the row rounded up as `bucket_width` rounds, with room for at least one
    padding column (the spare key rows sit in its sample, `fork_layout`), and the key side to the
    row width plus a multiple of a quarter of it, so a run's forwards repeat their shapes (CUDA
    graphs replay them; at most four key widths a row width)."""
    width = bucket_width(real + 1)
    step = max(1, width // 4)
    return width, width + -(-(keys - real) // step) * step


def shared_answer_rows(groups: list[Group], pad_id: int, device: torch.device) -> AnswerRows:
    """(prompt ids, [answer ids, ...]) groups -> one padding-free row [prompt, answer 1, answer 2, ...]
    per group, the prompt scored once (module docstring). Its rows are those `answer_rows` makes of
    the pairs [(prompt, answers[k]) for k for group] (answer-major: row k * G + g), with the same
    (R, L) log-probs. Answer k's token j is predicted by the state before it in its own branch:
    the prompt's last state for j = 0, else the answer's token j - 1."""
    count, n = len(groups[0][1]), len(groups)
    if any(len(answers) != count for _, answers in groups):
        raise ValueError("every group of a shared batch needs the same number of answers")
    real = sum(len(p) + sum(len(a) for a in answers) for p, answers in groups)
    keys = real + sum(len(p) * (count - 1) for p, _ in groups)
    width, key_width = shared_widths(real, keys)
    ids = torch.full((1, width), pad_id, dtype=torch.long)
    positions = torch.zeros((1, width), dtype=torch.long)
    scored: dict[int, tuple[list[int], torch.Tensor]] = {}  # row -> (answer tokens, predicting columns)
    at = 0
    for g, (prompt, answers) in enumerate(groups):
        ids[0, at : at + len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        positions[0, at : at + len(prompt)] = torch.arange(len(prompt))
        start = at + len(prompt)
        for k, answer in enumerate(answers):
            ids[0, start : start + len(answer)] = torch.tensor(answer, dtype=torch.long)
            positions[0, start : start + len(answer)] = torch.arange(len(prompt), len(prompt) + len(answer))
            cols = start - 1 + torch.arange(len(answer))
            cols[0] = at + len(prompt) - 1  # every answer's first token: the prompt's last state
            scored[k * n + g] = (answer, cols)
            start += len(answer)
        at = start
    positions[0, at:] = torch.arange(width - at)  # the padding tail is one more "sequence"
    rows = [scored[r] for r in range(count * n)]
    length = max(len(t) for t, _ in rows)
    slots = torch.cat([r * length + torch.arange(len(t)) for r, (t, _) in enumerate(rows)])
    lengths = [(len(p), [len(a) for a in answers]) for p, answers in groups]
    forks = (fork_layout(lengths, width, key_width, device), fork_layout(lengths, real, keys, device))
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    return AnswerRows(
        move(ids), move(positions), move(torch.zeros(len(slots), dtype=torch.long)), move(torch.cat([c for _, c in rows])),
        real, move(torch.tensor([t for answer, _ in rows for t in answer], dtype=torch.long)), move(slots),
        (len(rows), length), move(torch.tensor([len(t) for t, _ in rows], dtype=torch.long)),
        sum(len(p) * count + sum(len(a) for a in answers) for p, answers in groups), forks)


FSDP_SCORE = "kestrel_answer_logprobs"  # the FSDP2 forward method `score_through_fsdp` adds


def answer_logprobs(model: nn.Module, rows: AnswerRows) -> torch.Tensor:
    """log pi(answer token | everything before it) for every row: (R, L) fp32, 0 past each answer.
    Differentiable w.r.t. the trainable weights when grad is enabled; the adapter state
    (enabled or disabled) is the caller's."""
    lm = causal_lm(model)
    routed = getattr(lm, FSDP_SCORE, None)
    return routed(rows) if routed is not None else _answer_logprobs(lm, rows)


def score_through_fsdp(model: nn.Module) -> None:
    """A full fine-tune sharded with FSDP2 (`kestrel.training.distributed.shard_full_model`):
    scoring calls the decoder stack and the head's weight, not the model's forward, so FSDP2's
    root hooks (gather the embeddings, norm and head before, reduce-scatter their gradients after
    the backward) would not run. Registering the scoring as one of the root's forward methods
    runs them around it."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    lm = causal_lm(model)
    setattr(lm, FSDP_SCORE, functools.partial(_answer_logprobs, lm))
    register_fsdp_forward_method(lm, FSDP_SCORE)


def _layout(rows: AnswerRows, rounded: bool, cols: int) -> dict[str, Any]:
    """The forward's layout keyword for the first `cols` columns: the shared prompts' forks, else the flat
    rows' host starts (a prefix of the columns starts where the whole row does)."""
    if rows.forks is not None:
        return {FORK_KWARG: rows.forks[0 if rounded else 1]}
    if rows.starts is not None and rows.starts.starts is not None:
        return {STARTS_KWARG: HostStarts(rows.starts.starts[:, :cols])}
    return {}


def _answer_logprobs(lm: nn.Module, rows: AnswerRows) -> torch.Tensor:
    rounded = torch.is_grad_enabled() or replays_training_shapes(lm)
    cols = rows.input_ids.shape[1] if rounded else rows.used  # no gradient: no padding columns (module docstring)
    positions = None if rows.position_ids is None else rows.position_ids[:, :cols]
    hidden = lm.model(input_ids=rows.input_ids[:, :cols], position_ids=positions, use_cache=False,
                      **_layout(rows, rounded, cols)).last_hidden_state
    h = hidden[rows.row, rows.col]  # (N, H): the answer tokens' predicting states, no padding
    softcap = logit_softcap(lm.config)  # an image-text model's is its language model's
    logp = kernels.chunked_token_logprobs(h, lm.lm_head.weight, rows.targets, softcap=softcap)  # (N,)
    r, length = rows.shape
    return logp.new_zeros(r * length).index_put((rows.slots,), logp).view(r, length)  # (R, L), 0 past each end
