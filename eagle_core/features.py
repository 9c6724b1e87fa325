"""Conversations -> training features: regenerate assistant turns with the target, then tokenise with the
chat template + loss mask and capture the aux and final hidden states, batched by similar length.

Pure torch + transformers; the Ray stages in `pipelines/extract/` call these once per shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from eagle_core.chat import NoChatTemplateError, TemplateError, prompt_ids, tokenize_conversation
from eagle_core.capture import capture_features

TRUNCATED = ("mark", "drop")  # what regeneration does with a reply cut at max_new_tokens (see regenerate_conversations)


@dataclass
class FeatureRow:
    id: str
    input_ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] int8
    aux_hidden: torch.Tensor  # [S, 3H] in the target's compute dtype
    last_hidden: torch.Tensor  # [S, H]


def _pad_left(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


class Reply(NamedTuple):
    text: str
    truncated: bool  # cut at max_new_tokens (OpenAI: finish_reason "length"): the turn never ended


@torch.no_grad()
def generate_ids(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                 seed: int) -> list[list[int]]:
    """Batched HF generation with left padding; the generated ids of each prompt (padding after EOS removed)."""
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids, attention_mask = _pad_left(prompts, pad_id, device)
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 else {
        "do_sample": False}
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                         pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id, **sampling)
    rows = []
    for row in out[:, input_ids.shape[1]:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        rows.append(row)
    return rows


def generate_replies(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                     seed: int) -> list[Reply]:
    """Replies of the target in this process (special tokens dropped from the text); a reply that did not end
    with EOS within `max_new_tokens` is marked truncated."""
    rows = generate_ids(model, tokenizer, prompts, max_new_tokens, temperature, seed)
    return [Reply(tokenizer.decode(row, skip_special_tokens=True).strip(), tokenizer.eos_token_id not in row)
            for row in rows]


def _regenerated(message: dict) -> bool:
    """Assistant turns that regeneration rewrites: those without tool calls. A turn that calls tools stays as the
    corpus has it, since the tools cannot be run here and the tool results that follow answer exactly its calls."""
    return message["role"] == "assistant" and not message.get("tool_calls")


def regenerate_conversations(model, tokenizer, conversations: list[dict], max_new_tokens: int = 512,
                             temperature: float = 0.0, seed: int = 0, max_length: int = 2048,
                             batch_size: int = 16, replies=None,
                             truncated: str = "mark") -> tuple[list[dict], dict[str, str]]:
    """Rewrite the assistant turns with the target, turn by turn, each conditioned on the rewritten history.

    `replies(prompts, seed) -> [Reply or str]` answers a batch of tokenised prompts: by default `model` in this
    process (`generate_replies`); any serving engine otherwise (`pipelines.regenerate.OpenAIReplies`, whose
    `check_target(model, tokenizer)` runs first: the server must serve this target).

    Assistant turns that call tools are kept as they are (`_regenerated`); tool results, user and system turns
    are copied. Conversations advance together: all those with a k-th turn to rewrite are generated in batches.
    A conversation stops at the first turn whose prompt no longer fits `max_length` (later turns would be
    truncated away anyway), whose reply is empty, or whose reply was cut at `max_new_tokens`: with
    `truncated="mark"` that reply is kept as the last turn, marked `"truncated": true` (trained on, without an
    end-of-turn token); with `"drop"` the conversation ends before it. Returns (rewritten conversations,
    {id: reason} of those left with no assistant turn). A tokenizer without a chat template stops the whole
    call (`NoChatTemplateError`); a template that refuses one conversation quarantines that one.
    """
    if truncated not in TRUNCATED:
        raise ValueError(f"truncated must be one of {TRUNCATED}, got {truncated!r}")
    if replies is None:
        def replies(prompts, batch_seed):
            return generate_replies(model, tokenizer, prompts, max_new_tokens, temperature, batch_seed)
    elif hasattr(replies, "check_target"):
        replies.check_target(model, tokenizer)
    history = [[] for _ in conversations]  # rewritten messages so far
    pending = [list(c["messages"]) for c in conversations]  # original messages still to go
    alive = [True] * len(conversations)
    refused: dict[int, str] = {}
    turn = 0
    while True:
        # Copy the turns kept as they are up to the next turn to rewrite, then collect this turn's prompts.
        work = []
        for i, msgs in enumerate(pending):
            while alive[i] and msgs and not _regenerated(msgs[0]):
                history[i].append(msgs.pop(0))
            if alive[i] and msgs:
                try:
                    ids = prompt_ids(tokenizer, history[i], tools=conversations[i].get("tools"))
                except NoChatTemplateError:
                    raise
                except TemplateError as err:
                    alive[i], refused[i] = False, err.reason
                    continue
                if len(ids) >= max_length:
                    alive[i] = False
                else:
                    work.append((i, ids))
        if not work:
            break
        for start in range(0, len(work), batch_size):
            chunk = work[start:start + batch_size]
            answers = replies([ids for _, ids in chunk], seed + 1000 * turn + start)
            for (i, _), answer in zip(chunk, answers):
                text, cut = (answer, False) if isinstance(answer, str) else (answer.text, answer.truncated)
                pending[i].pop(0)
                if not text or (cut and truncated == "drop"):
                    alive[i] = False
                    continue
                history[i].append({"role": "assistant", "content": text, **({"truncated": True} if cut else {})})
                if cut:
                    alive[i] = False  # later turns would answer a reply the target never finished
        turn += 1
    rewritten, quarantined = [], {}
    for i, (conv, msgs) in enumerate(zip(conversations, history)):
        while msgs and msgs[-1]["role"] != "assistant":
            msgs.pop()  # a trailing question whose answer was not generated teaches nothing
        if i in refused:
            quarantined[conv["id"]] = refused[i]
        elif msgs:
            row = {"id": conv["id"], "messages": msgs}
            if conv.get("tools"):
                row["tools"] = conv["tools"]
            rewritten.append(row)
        else:
            quarantined[conv["id"]] = "empty_regeneration"
    return rewritten, quarantined


def tokenize_for_training(tokenizer, conversations: list[dict], max_length: int):
    """(tokenised rows, {id: reason}) — rows the chat template cannot render faithfully are quarantined with the
    template error's reason, and rows whose loss mask is empty after truncation as "no_loss_tokens". A tokenizer
    without a chat template stops the call (`NoChatTemplateError`): no row could be used."""
    rows, quarantined = [], {}
    for conv in conversations:
        try:
            tok = tokenize_conversation(tokenizer, conv["messages"], max_length=max_length, tools=conv.get("tools"))
        except NoChatTemplateError:
            raise
        except TemplateError as err:
            quarantined[conv["id"]] = err.reason
            continue
        if not any(tok.loss_mask):
            quarantined[conv["id"]] = "no_loss_tokens"
            continue
        rows.append((conv["id"], tok.input_ids, tok.loss_mask))
    return rows, quarantined


def length_batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Indices grouped by similar length so padding waste stays small; each batch's padded size
    (rows x longest row) stays within `tokens_per_batch` (a longer single row gets its own batch)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@torch.no_grad()
def featurize(model, tokenized: list[tuple[str, list[int], list[int]]], aux_layer_ids: list[int],
              tokens_per_batch: int = 8192) -> list[FeatureRow]:
    """Target forward over tokenised rows (right-padded, batched by length); rows come back in input order."""
    device = next(model.parameters()).device
    out: list[FeatureRow | None] = [None] * len(tokenized)
    for batch in length_batches([len(t[1]) for t in tokenized], tokens_per_batch):
        width = max(len(tokenized[i][1]) for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            n = len(tokenized[i][1])
            ids[r, :n] = torch.tensor(tokenized[i][1])
            mask[r, :n] = 1
        # Right padding: real positions never attend to pads, so their features match an unpadded forward.
        feats = capture_features(model, ids.to(device), mask.to(device) if len(batch) > 1 else None, aux_layer_ids)
        for r, i in enumerate(batch):
            row_id, input_ids, loss_mask = tokenized[i]
            n = len(input_ids)
            out[i] = FeatureRow(id=row_id, input_ids=torch.tensor(input_ids), loss_mask=torch.tensor(loss_mask, dtype=torch.int8),
                                aux_hidden=feats.aux_hidden[r, :n].cpu(), last_hidden=feats.last_hidden[r, :n].cpu())
    return out
