"""Features in this process, without Ray (`local_feature_batches`): for benchmarks, tests and streaming
distillation."""

from __future__ import annotations

import torch


def local_feature_batches(model, tokenizer, n: int, max_length: int, min_loss_tokens: int = 32, skip: int = 0,
                          corpus: str | None = None, progress: str | None = None) -> list[dict]:
    """Features of the first usable conversations of a corpus file, in this process (no Ray, no regeneration):
    one batch {input_ids, loss_mask, aux_hidden, last_hidden} per conversation with at least
    `min_loss_tokens` loss tokens, after skipping `skip` of them. For benchmarks, tests and streaming distillation."""
    from itertools import islice

    from eagle_core.capture import capture_features
    from pipelines.distill import iter_usable

    batches = []
    for input_ids, loss_mask in islice(iter_usable(tokenizer, corpus, max_length, min_loss_tokens), skip, skip + n):
        ids = torch.tensor([input_ids])
        feats = capture_features(model, ids)
        batches.append(dict(input_ids=ids, loss_mask=torch.tensor([loss_mask]),
                            aux_hidden=feats.aux_hidden, last_hidden=feats.last_hidden))
        if progress and len(batches) % 20 == 0:
            print(f"[{progress}] features of {len(batches)} conversations", flush=True)
    return batches
