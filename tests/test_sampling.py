"""Speculative sampling is lossless: the first three sampled tokens follow the target's exact law.

Small-vocab tiny target, thousands of independent requests in one batch (each with its own seed), a
chi-square test of the joint (x1, x2, x3) against the exact distribution computed from the target by
enumeration. The same test must FAIL for a deliberately wrong verifier (each node scored with the noise
of its own position instead of the next one's, so a round's first token reuses the previous token's
randomness), otherwise it proves nothing.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare

import eagle_core.verify as verify
from decode_helpers import echo_draft, random_draft, single_thread  # noqa: F401 (autouse fixture)
from eagle_core.generate import generate
from eagle_core.target import make_tiny_llama
from eagle_core.tree import TreeConfig
from eagle_core.verify import SamplingConfig, target_probs

VOCAB, N, PROMPT = 12, 3000, [3, 7, 1, 9, 4]
# The target mostly repeats its last token; after a first 7 the prompt lookup proposes 7s (a run of them ends the
# prompt), which the chain's own slots carry wherever the (random) draft's tree did not propose them
LOOKUP_PROMPT = [3, 1, 9, 4, 7, 7, 7, 7]


@pytest.fixture(scope="module")
def target():
    model = make_tiny_llama(vocab_size=VOCAB, dtype=torch.float64, seed=11)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(2.5)  # moderately peaked next-token distributions (tied lm_head)
    return model


@torch.inference_mode()
def exact_joint(target, sampling: SamplingConfig, prompt=PROMPT) -> torch.Tensor:
    """p(x1, x2, x3 | prompt) over VOCAB^3, by enumerating prefixes."""
    def next_probs(prefixes):
        logits = target(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        return target_probs(logits, sampling).double()

    p1 = next_probs([()])[0]  # [V]
    p2 = next_probs([(a,) for a in range(VOCAB)])  # [V, V]
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    p3 = next_probs(pairs).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def sampled_counts(target, sampling: SamplingConfig, seed: int, prompt=PROMPT, tree=TreeConfig(3, 3, 8), mode="tree",
                   on_round=None, draft=None) -> tuple[torch.Tensor, list]:
    res = generate(target, [prompt] * N, draft=draft or echo_draft(target), tree=tree, mode=mode, max_new_tokens=3,
                   temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=seed,
                   on_round=on_round)
    index = torch.tensor([(a * VOCAB + b) * VOCAB + c for a, b, c in res.tokens])
    return torch.bincount(index, minlength=VOCAB ** 3).double(), res.stats


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.flatten() * counts.sum()
    big = expected >= 5  # pool the sparse cells so the chi-square approximation holds
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


SAMPLINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_p=0.9, top_k=6)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_speculative_sampling_matches_the_target_distribution(target, sampling):
    counts, stats = sampled_counts(target, sampling, seed=1)
    # the test only means something if drafts were both accepted and rejected
    lengths = [a for s in stats for a in s.accept_lengths]
    assert 0 < sum(lengths) and lengths.count(0) > 0
    assert chi_square_pvalue(counts, exact_joint(target, sampling)) > 1e-3


def test_wrong_verifier_fails_the_same_test(target, monkeypatch):
    """Noise of the wrong position (off by one): consecutive tokens share their randomness."""
    monkeypatch.setattr(verify, "level_positions", lambda root_positions, levels: root_positions[:, None] + levels)
    sampling = SAMPLINGS[0]
    counts, _ = sampled_counts(target, sampling, seed=1)
    assert chi_square_pvalue(counts, exact_joint(target, sampling)) < 1e-6


def test_plain_sampling_matches_the_target_distribution(target):
    """The reference sampler itself passes (so a failure above is the verifier's, not the test's)."""
    sampling = SAMPLINGS[1]
    res = generate(target, [PROMPT] * N, max_new_tokens=3, temperature=sampling.temperature,
                   top_p=sampling.top_p, top_k=sampling.top_k, seed=2)
    index = torch.tensor([(a * VOCAB + b) * VOCAB + c for a, b, c in res.tokens])
    counts = torch.bincount(index, minlength=VOCAB ** 3).double()
    assert chi_square_pvalue(counts, exact_joint(target, sampling)) > 1e-3


@pytest.mark.parametrize("wrong", [False, True], ids=["exact", "wrong-positions"])
def test_context_chain_sampling_matches_the_target_distribution(target, monkeypatch, wrong):
    """The tree with a grafted context chain (mode "context", a prompt whose lookup matches): the joint of the first
    three tokens is the target's, with the chain's own slots accepted in many rounds; the same test fails when
    the chain's slots sit one position too far (their logits and their noise are then another position's)."""
    import eagle_core.decoding as decoding

    if wrong:
        graft = decoding.graft_chain

        def misplaced(tree, chain):
            g = graft(tree, chain)
            g.depth = g.depth + (torch.arange(g.size) >= g.draft_size).long()
            return g

        monkeypatch.setattr(decoding, "graft_chain", misplaced)
    sampling = SAMPLINGS[1]
    in_chain = []

    def on_round(out, _):
        if out.tree.draft_size is not None:
            steps = torch.arange(out.path.shape[1])[None, :]
            hit = (out.path >= out.tree.draft_size) & (steps <= out.accept_length[:, None])
            in_chain.append(int(hit.any(dim=1).sum()))

    counts, stats = sampled_counts(target, sampling, 3, LOOKUP_PROMPT, TreeConfig(2, 2, 3, context_chain=4),
                                   "context", on_round, random_draft(target, VOCAB))
    pvalue = chi_square_pvalue(counts, exact_joint(target, sampling, LOOKUP_PROMPT))
    if wrong:
        assert pvalue < 1e-6
    else:
        assert sum(in_chain) > N // 20 and pvalue > 1e-3
