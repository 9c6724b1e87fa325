"""Drafts for the decoding tests (imported by test_tree/test_verify/test_generate/test_sampling)."""

import pytest
import torch

from eagle_core.draft import DraftConfig, Eagle3Draft
from eagle_core.target import make_tiny_llama


def random_draft(target, draft_vocab_size: int, seed: int = 0, **kind) -> Eagle3Draft:
    """A random-weight draft (its proposals are noise: acceptance is mostly 0); `kind`: DraftConfig switches."""
    config = DraftConfig.from_target(target.config, draft_vocab_size=draft_vocab_size, **kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = Eagle3Draft(config, target_embed_weight=target.get_input_embeddings().weight)
    # Random trees need spread-out scores, not a near-uniform draft: scale the lm_head up.
    with torch.no_grad():
        draft.get_parameter("lm_head.weight").mul_(50.0)
    return draft.to(target.dtype).eval()


def echo_draft(target, **kind) -> Eagle3Draft:
    """A hand-set draft that proposes "the root token again" with the target's own output embedding.

    fc passes the target's first aux layer through, the midlayer adds nothing (o_proj, down_proj = 0) and
    lm_head is the target's embedding: the draft predicts the token whose embedding best matches the
    current one. Tiny random Llamas repeat themselves often, so this draft gets long accepted paths
    (tau well above 1), which the lossless tests need to exercise multi-token acceptance.
    """
    h = target.config.hidden_size
    config = DraftConfig.from_target(target.config, draft_vocab_size=target.config.vocab_size, **kind)
    emb = target.get_input_embeddings().weight
    draft = Eagle3Draft(config, target_embed_weight=emb).to(target.dtype)
    with torch.no_grad():
        fc = draft.get_parameter("fc.weight")
        fc.zero_()
        fc[:, h: 2 * h] = torch.eye(h, dtype=fc.dtype)
        draft.get_parameter("midlayer.self_attn.o_proj.weight").zero_()
        draft.get_parameter("midlayer.mlp.down_proj.weight").zero_()
        draft.get_parameter("lm_head.weight").copy_(target.get_output_embeddings().weight)
    return draft.eval()


def damped_tiny_llama(eps: float, **kw):
    """A tiny Llama whose blocks are scaled by eps: it mostly repeats its input (eps=0: always)."""
    target = make_tiny_llama(**kw)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(eps)
            layer.mlp.down_proj.weight.mul_(eps)
    return target


def random_prompts(n: int, vocab: int, lo: int = 3, hi: int = 20, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny-model tests run ~20x faster on one thread when the 2 cores are shared (OpenMP spin-waits)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class IdTokenizer:
    """What the serving engine needs of a tokenizer, for targets without one: token ids as `<id>` text, no eos."""

    eos_token_id = None

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(f"<{t}>" for t in tokens)


def run_engine(engine, requests: list[tuple], timeout: float = 120.0) -> list:
    """Submit (prompt ids, max tokens, SamplingConfig, seed) requests to a serving `Engine` at once, wait for every
    final event (done or error) and close the engine; the final events in request order."""
    import threading

    from pipelines.serve.rows import GenerationRequest

    done, finished = {}, threading.Semaphore(0)

    def on_event(i):
        def handle(event):
            if event.kind != "delta":
                done[i] = event
                finished.release()
        return handle

    try:
        for i, (prompt, max_tokens, sampling, seed) in enumerate(requests):
            engine.submit(GenerationRequest(prompt, max_tokens, sampling, on_event(i), seed=seed))
        for _ in requests:
            assert finished.acquire(timeout=timeout), "the engine did not finish every request in time"
    finally:
        engine.close()
    return [done[i] for i in range(len(requests))]


def drafted_batch(seed: int = 1):
    """A tiny float64 target, a random draft and 3 prompts prefilled into both caches, the draft extended up to
    roots 7, 8, 9: (draft, draft cache, the draft's hidden states for tree building, roots)."""
    from eagle_core.decoding import draft_extend, prefill
    from eagle_core.kv import DraftKV, TargetKV

    target = make_tiny_llama(dtype=torch.float64)
    draft = random_draft(target, draft_vocab_size=300)
    prompts = random_prompts(3, 512, seed=seed)
    kv, dkv = TargetKV(3, "cpu"), DraftKV(3, "cpu")
    _, aux, ids, lengths = prefill(target, kv, prompts, list(draft.config.aux_layer_ids))
    root = torch.tensor([7, 8, 9])
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter(1, (lengths - 1)[:, None], root[:, None])
    return draft, dkv, draft_extend(draft, dkv, aux, nxt, lengths), root
