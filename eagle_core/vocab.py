"""Draft vocabulary: the `draft_vocab_size` most frequent target tokens under the loss mask.

Counting is streaming and mergeable (each data worker counts its shard; `merge` adds the partial counts),
so the vocabulary of a corpus that never fits in one process is still exact.

Mapping convention (vLLM / SGLang / speculators): draft ids are the chosen target ids in ascending order;
`d2t[i]` (int64) is the offset with target_id = i + d2t[i]; `t2d` is bool[target_vocab], True for ids
the draft can propose.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class TokenCounter:
    """Counts target token ids where the loss mask is set (the tokens the draft must predict)."""

    def __init__(self, target_vocab_size: int):
        self.target_vocab_size = target_vocab_size
        self.counts = torch.zeros(target_vocab_size, dtype=torch.long)

    def update(self, input_ids, loss_mask=None) -> "TokenCounter":
        # input_ids, loss_mask: any shape (lists, numpy or tensors); mask None = count every token
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        if loss_mask is not None:
            mask = torch.as_tensor(loss_mask).reshape(-1).to(torch.bool)
            if mask.shape != ids.shape:
                raise ValueError(f"loss_mask has {mask.numel()} entries for {ids.numel()} tokens")
            ids = ids[mask]
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.target_vocab_size):
            raise ValueError(f"token id out of range 0..{self.target_vocab_size - 1}")
        self.counts += torch.bincount(ids.cpu(), minlength=self.target_vocab_size)
        return self

    def merge(self, other: "TokenCounter | torch.Tensor") -> "TokenCounter":
        counts = other.counts if isinstance(other, TokenCounter) else torch.as_tensor(other, dtype=torch.long)
        if counts.shape != self.counts.shape:
            raise ValueError(f"cannot merge counts over {counts.numel()} ids into {self.target_vocab_size}")
        self.counts += counts.cpu()
        return self

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @property
    def distinct(self) -> int:
        return int((self.counts > 0).sum())


def count_tokens(rows: Iterable, target_vocab_size: int) -> TokenCounter:
    """Count an iterable of `(input_ids, loss_mask)` pairs or dicts with those keys."""
    counter = TokenCounter(target_vocab_size)
    for row in rows:
        if isinstance(row, dict):
            counter.update(row["input_ids"], row.get("loss_mask"))
        else:
            counter.update(*row)
    return counter


def select_draft_ids(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Ascending target ids of the draft vocab: most frequent first, ties and padding by lowest id.

    A corpus with fewer distinct tokens than `draft_vocab_size` is padded with the lowest unused ids, so
    the draft vocabulary always has the configured size (the export shapes depend on it).
    """
    counts = torch.as_tensor(counts, dtype=torch.long).cpu()
    if not 0 < draft_vocab_size <= counts.numel():
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{counts.numel()}")
    # A stable sort on descending counts keeps lower ids first among equal counts (zero counts included).
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def build_vocab_mapping(counts, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [draft_vocab] int64, t2d [target_vocab] bool) from token counts (a tensor or a TokenCounter)."""
    if isinstance(counts, TokenCounter):
        counts = counts.counts
    draft_ids = select_draft_ids(counts, draft_vocab_size)
    return mapping_from_draft_ids(draft_ids, len(counts))


def mapping_from_draft_ids(draft_ids: torch.Tensor, target_vocab_size: int):
    draft_ids = torch.sort(torch.as_tensor(draft_ids, dtype=torch.long)).values
    d2t = draft_ids - torch.arange(draft_ids.numel())
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def draft_ids_from_mapping(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids of the draft vocab, in draft order."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise if d2t and t2d disagree (a corrupted or hand-edited checkpoint)."""
    ids = draft_ids_from_mapping(d2t)
    if ids.numel() and (ids.min() < 0 or ids.max() >= t2d.numel()):
        raise ValueError("d2t maps draft ids outside the target vocabulary")
    if not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("d2t must map draft ids to strictly increasing target ids")
    if int(t2d.sum()) != ids.numel() or not bool(t2d[ids].all()):
        raise ValueError("t2d does not mark exactly the target ids that d2t maps to")
