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
from decode_helpers import echo_draft, single_thread  # noqa: F401 (autouse fixture)
from eagle_core.generate import generate
from eagle_core.target import make_tiny_llama
from eagle_core.tree import TreeConfig
from eagle_core.verify import SamplingConfig, target_probs

VOCAB, N, PROMPT = 12, 3000, [3, 7, 1, 9, 4]


@pytest.fixture(scope="module")
def target():
    model = make_tiny_llama(vocab_size=VOCAB, dtype=torch.float64, seed=11)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(2.5)  # moderately peaked next-token distributions (tied lm_head)
    return model


@torch.inference_mode()
def exact_joint(target, sampling: SamplingConfig) -> torch.Tensor:
    """p(x1, x2, x3 | prompt) over VOCAB^3, by enumerating prefixes."""
    def next_probs(prefixes):
        logits = target(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
        return target_probs(logits, sampling).double()

    p1 = next_probs([()])[0]  # [V]
    p2 = next_probs([(a,) for a in range(VOCAB)])  # [V, V]
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    p3 = next_probs(pairs).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def sampled_counts(target, sampling: SamplingConfig, seed: int) -> tuple[torch.Tensor, list]:
    res = generate(target, [PROMPT] * N, draft=echo_draft(target), tree=TreeConfig(3, 3, 8), mode="tree",
                   max_new_tokens=3,
                   temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=seed)
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
