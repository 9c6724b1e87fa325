"""What a TTT batch is: its layout (one conversation per row, right-padded, or several packed into each row), which
of its columns count at each TTT step, and the refusal of a batch that cannot train a draft.

A batch: input_ids, loss_mask [B, L]; aux_hidden [B, L, 3 Ht]; last_hidden [B, L, Ht]; optionally attention_mask
[B, L] (1 = a real token), position_ids [B, L] and targets (`eagle_core.teacher.with_targets`).

Packed rows (sequence packing): position_ids restart at 0 where a conversation starts and count up by one inside
it (the convention of transformers' packed collators). Column t belongs to the conversation that starts at column
t - position_ids[t] (`document_starts`); attention sees only the keys of that conversation (block-diagonal causal,
`eagle_core.ttt_ops.ttt_attention`), and step k counts column t only when the token it predicts, t+k+2, is in the
same conversation (`step_mask`), so no TTT step crosses a boundary. Without position_ids a row is one conversation
(padding aside) and nothing here changes from the unpacked layout.
"""

from __future__ import annotations

import torch


class BadBatch(ValueError):
    """A training batch that cannot train the draft; the message names what is wrong."""


def document_starts(position_ids):
    """[B, L] -> [B, L]: the column where column t's conversation starts (t - position_ids[t])."""
    return torch.arange(position_ids.shape[1], device=position_ids.device) - position_ids


def step_mask(loss_mask, column_mask, length: int, k: int, starts=None):
    """[B, n] with n = max(length - k - 2, 0): which columns t count at step k. Column t predicts token t+k+2, so
    loss_mask[t+k+2]; a padded column (column_mask 0) holds no real feature and never counts (left padding); with
    `starts` (`document_starts` of a packed batch) token t+k+2 must belong to column t's conversation."""
    n = max(length - k - 2, 0)
    mask = loss_mask[:, k + 2:]
    if column_mask is not None:
        mask = mask * column_mask[:, :n].to(mask.dtype)
    if starts is not None:
        mask = mask * (starts[:, k + 2:] == starts[:, :n]).to(mask.dtype)
    return mask


def step_counts(batch: dict, ttt_steps: int) -> torch.Tensor:
    """[K] loss positions of each TTT step in this batch: those `ttt_forward` counts (`step_mask`: loss_mask[t+k+2]
    at a real column t, of t's conversation in a packed batch)."""
    real = batch["attention_mask"]
    mask = batch["loss_mask"].float() * real
    positions = batch.get("position_ids")
    starts = None if positions is None else document_starts(positions)
    return torch.stack([step_mask(mask, real, mask.shape[1], k, starts).sum() for k in range(ttt_steps)])


# ---------------------------------------------------------------------------------------------------
# packing


def refuse_longer_than_row(lengths: list[int], pack_length: int, names: list | None = None,
                           within: str = "a packed row", option: str = "pack_length") -> None:
    """BadBatch naming the conversations (`names[i]`, else their index) longer than a packed row (or `within`, set by
    `option`: a micro-batch): cutting one would train its second part without the context of its first. The
    training driver calls it on the plan's lengths, before any worker starts; `pack_rows` on every batch it packs."""
    too_long = [(names[i] if names is not None else i, n) for i, n in enumerate(lengths) if n > pack_length]
    if too_long:
        raise BadBatch(f"conversation(s) {too_long[:5]} (name, tokens){' and more' if len(too_long) > 5 else ''} are "
                       f"longer than {within} of {pack_length} tokens: raise {option} or "
                       "drop them at extraction (max_length)")


def pack_rows(lengths: list[int], pack_length: int, names: list | None = None) -> list[list[int]]:
    """Which conversations share a row of `pack_length` tokens: first-fit over the conversations longest first (few
    rows, deterministic). Returns per row the indices into `lengths`, in the order they are laid out.
    A conversation longer than the row is refused (`refuse_longer_than_row`)."""
    refuse_longer_than_row(lengths, pack_length, names)
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: equal lengths keep their order
        r = next((r for r, f in enumerate(free) if lengths[i] <= f), len(rows))
        if r == len(rows):
            rows.append([])
            free.append(pack_length)
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def layout_batch(conversations: list[dict], pack_length: int | None = None, names: list | None = None) -> dict:
    """A batch from conversations {input_ids [n], loss_mask [n], aux_hidden [n, 3Ht], last_hidden [n, Ht]}.

    pack_length None: one conversation per row, right-padded to the longest (no position_ids: the unpacked layout).
    pack_length N: conversations packed into rows of at most N tokens (`pack_rows`), with position_ids restarting
    at each conversation; rows are padded to the fullest row, not to N. Padding is zeros with attention_mask 0."""
    if not conversations:
        raise ValueError("layout_batch needs at least one conversation")
    groups = [[i] for i in range(len(conversations))] if pack_length is None else pack_rows(
        [len(c["input_ids"]) for c in conversations], pack_length, names)
    first = conversations[0]
    B = len(groups)
    L = max(sum(len(conversations[i]["input_ids"]) for i in g) for g in groups)
    batch = {key: first[key].new_zeros((B, L, *first[key].shape[1:]))
             for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden")}
    batch["attention_mask"] = torch.zeros(B, L, dtype=torch.long)
    if pack_length is not None:
        batch["position_ids"] = torch.zeros(B, L, dtype=torch.long)
    for b, group in enumerate(groups):
        at = 0
        for i in group:
            c = conversations[i]
            n = len(c["input_ids"])
            for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
                batch[key][b, at:at + n] = c[key]
            batch["attention_mask"][b, at:at + n] = 1
            if pack_length is not None:
                batch["position_ids"][b, at:at + n] = torch.arange(n)
            at += n
    return batch


# ---------------------------------------------------------------------------------------------------
# refusal


def check_batch(draft, batch: dict, target_lm_head_weight=None, contents: bool = True) -> None:
    """Refuse a batch that does not fit `draft` or holds nothing to learn (BadBatch naming it).

    Shapes: per-token tensors that disagree with input_ids, features of another target (hidden size) or other aux
    layers, a target head of another vocabulary, a teacher over another draft vocabulary.
    With `contents`: token ids outside the target's vocabulary; position_ids that do not restart at 0 and count up
    by one inside each conversation (a row that begins inside a conversation is one cut by a packer: a conversation
    longer than the row); and a conversation of real tokens whose loss mask selects none that a TTT step counts (a
    row without real tokens, attention mask all 0, is the distributed loop's dummy row: no error).
    `train_step` checks the shapes of every batch (no host sync; a misfit would fail later, less clearly); the
    caller that builds the batches checks their contents too (on the CPU, before they move to the device)."""
    _check_shapes(draft.config, batch, target_lm_head_weight)
    if contents:
        _check_contents(draft.config, batch)


def _check_shapes(cfg, batch: dict, target_lm_head_weight) -> None:
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise BadBatch(f"input_ids must be [batch, length], got shape {list(ids.shape)}")
    B, L = ids.shape
    for name in ("loss_mask", "attention_mask", "position_ids"):
        if batch.get(name) is not None and tuple(batch[name].shape) != (B, L):
            raise BadBatch(f"{name} is {list(batch[name].shape)}, input_ids {[B, L]}: one entry per token needed")
    H, n_aux = cfg.target_hidden_size, len(cfg.aux_layer_ids)
    last, aux = batch["last_hidden"], batch["aux_hidden"]
    if tuple(last.shape) != (B, L, H):
        raise BadBatch(f"last_hidden is {list(last.shape)}; this draft needs {[B, L, H]} (the target's hidden size "
                       f"{H}): features of another target, or of another length")
    if tuple(aux.shape) != (B, L, n_aux * H):
        width = aux.shape[-1] if aux.dim() == 3 else None
        held = (f"{width // H} aux layers of hidden {H}" if width and width % H == 0
                else f"a width of {width}, no whole number of layers of hidden {H}")
        raise BadBatch(f"aux_hidden is {list(aux.shape)}; this draft needs {[B, L, n_aux * H]} ({n_aux} aux layers "
                       f"{cfg.aux_layer_ids} x target hidden {H}); the features hold {held}: features of another "
                       "target, aux layers or length")
    if target_lm_head_weight is not None and tuple(target_lm_head_weight.shape) != (cfg.target_vocab_size, H):
        raise BadBatch(f"the target's lm_head is {list(target_lm_head_weight.shape)}; this draft needs "
                       f"{[cfg.target_vocab_size, H]} (target vocabulary x hidden)")
    targets = batch.get("targets")
    if targets is not None and tuple(targets[0].shape) != (B, L, cfg.draft_vocab_size):
        raise BadBatch(f"targets' distribution is {list(targets[0].shape)}; this draft needs "
                       f"{[B, L, cfg.draft_vocab_size]} (its draft vocabulary)")


def _check_contents(cfg, batch: dict) -> None:
    ids = batch["input_ids"]
    B, L = ids.shape
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.target_vocab_size):
        raise BadBatch(f"input_ids hold {int(ids.min())}..{int(ids.max())}, outside the target's vocabulary "
                       f"0..{cfg.target_vocab_size - 1}")
    attention = batch.get("attention_mask")
    real = torch.ones(B, L, dtype=torch.bool, device=ids.device) if attention is None else attention.bool()
    positions = batch.get("position_ids")
    starts = None
    if positions is not None:
        _check_positions(positions, real)
        starts = document_starts(positions)
    # Step 0 counts column t when loss_mask[t+2] is set at a real column t of the same conversation (`step_mask`);
    # later steps count fewer. Each conversation, i.e. each column where one starts, needs one such column.
    counted = step_mask(batch["loss_mask"].float() * real, real, L, 0, starts)  # [B, L-2]
    begins = real & (positions == 0) if positions is not None else real & (real.long().cumsum(-1) == 1)
    index = begins.long().cumsum(-1).clamp(min=1) - 1  # [B, L]: the conversation of each column within its row
    per_conversation = torch.zeros(B, L, device=ids.device).scatter_add_(1, index[:, :counted.shape[1]], counted)
    b, t = (begins & (per_conversation.gather(1, index) == 0)).nonzero(as_tuple=True)
    if len(b):
        if positions is None:
            where = f"row(s) {b.tolist()}"
        else:
            ends = [t0 + int((starts[r, t0:] == t0).logical_and(real[r, t0:]).sum()) - 1 for r, t0 in
                    zip(b.tolist(), t.tolist())]
            where = "conversation(s) " + ", ".join(f"row {r} columns {t0}..{e}" for r, t0, e in
                                                   zip(b.tolist(), t.tolist(), ends))
        raise BadBatch(f"{where} of the batch have an empty loss mask (no token from position 2 of its conversation on "
                       "is marked for training): nothing to learn from them")


def _check_positions(positions, real) -> None:
    """Real columns: position 0 (a conversation starts) or one more than the real column before."""
    follows = torch.zeros_like(real)
    follows[:, 1:] = real[:, :-1] & (positions[:, 1:] == positions[:, :-1] + 1)
    bad = real & (positions != 0) & ~follows
    if bool(bad.any()):
        r, t = (int(i) for i in bad.nonzero()[0])
        first_real = int(real[r].long().argmax())
        what = (f"row {r} begins inside a conversation (position {int(positions[r, t])} at its first real column "
                f"{t}): a conversation longer than the row was cut" if t == first_real else
                f"row {r} column {t}: position {int(positions[r, t])} after {int(positions[r, t - 1])}")
        raise BadBatch(f"position_ids: {what}; a packed row's positions restart at 0 where a conversation starts "
                       "and count up by one inside it")
