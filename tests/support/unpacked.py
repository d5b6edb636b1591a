"""One batch of samples laid out twice: packed side by side in rows (positions restarting, as
Kestrel trains) and one sample per right-padded row (as any model reads them). For a family whose
Hugging Face forward does not keep packed samples apart (gpt-oss), the unpacked layout is
what HF's own masks get right; both layouts predict the same tokens, so summed losses, gradients
and each real token's logits agree."""

from __future__ import annotations

from dataclasses import dataclass

import torch

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class TwoLayouts:
    packed: Batch  # input_ids, labels, position_ids (B, T)
    unpacked: Batch  # input_ids, labels, attention_mask (S, L): one sample a row, right-padded
    where: tuple[torch.Tensor, torch.Tensor]  # (row, col) in `unpacked` of each packed token, (B, T) each
    num_items: int  # the labels predicted, for a summed loss


def two_layouts(rows: list[list[int]], vocab: int, seed: int, device: str = "cpu") -> TwoLayouts:
    """Random samples of the given lengths; `rows[b]` lists the samples packed into row b
    (each row's lengths summing to the same T). A sample's first label is ignored."""
    g = torch.Generator().manual_seed(seed)
    lengths = [n for row in rows for n in row]
    width = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()  # (S, L)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 0] = -100
    where_row, where_col, sample = [], [], 0
    for row in rows:
        where_row.append(torch.cat([torch.full((n,), sample + i) for i, n in enumerate(row)]))
        where_col.append(torch.cat([torch.arange(n) for n in row]))
        sample += len(row)
    r, c = torch.stack(where_row), torch.stack(where_col)  # (B, T)
    packed = {"input_ids": ids[r, c], "labels": labels[r, c], "position_ids": c.clone()}
    unpacked = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    num_items = int((labels != -100).sum())
    moved = {k: {n: t.to(device) for n, t in b.items()} for k, b in (("p", packed), ("u", unpacked))}
    return TwoLayouts(moved["p"], moved["u"], (r.to(device), c.to(device)), num_items)
