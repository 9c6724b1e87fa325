"""Sampling noise that needs neither a generator nor the host.

Noise (`eagle_core.verify.noise_uniforms` / `gumbel_noise`): SplitMix64 in int64 tensor arithmetic equals the
published algorithm and a pure-Python (arbitrary-precision integer) reference bit for bit, so every device that wraps
int64 arithmetic gives the same bits; its uniforms are uniform and independent across tokens, positions and seeds;
the Gumbel noise is always finite; a row's noise does not depend on its batch.
"""

import torch
from scipy.stats import chisquare, kstest

from eagle_core.verify import _GAMMA, _mix64_, _open_unit, gumbel_noise, noise_uniforms, seed_tensor

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def mix(x: int) -> int:
    """SplitMix64's finaliser on Python ints (exact: no wrapping to emulate)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def reference_uniform(seed: int, position: int, token: int) -> float:
    key = mix(mix((seed + GAMMA) & M64) ^ position)
    bits = mix((key + (token + 1) * GAMMA) & M64)
    return (2 * (bits >> 12) + 1) / 2 ** 53


def test_tensor_mix_is_splitmix64():
    """The published SplitMix64 outputs for seed 1234567 (state += gamma, then the finaliser)."""
    states = torch.tensor(1234567) + torch.arange(1, 6) * _GAMMA  # int64 multiplication wraps mod 2^64
    assert [v & M64 for v in _mix64_(states).tolist()] == [
        6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431, 16408922859458223821]


def test_uniforms_equal_the_pure_python_reference_bit_for_bit():
    seeds = [0, 1, 12345, -7, 2 ** 63 - 1, 2 ** 63 + 5, 2 ** 64 + 3, 0xDEADBEEFCAFEBABE]
    positions = torch.tensor([[0, 1, 77], [2 ** 31 + 9, 5, 4096], [3, 3, 3], [10, 11, 12], [0, 2 ** 40, 9],
                              [6, 7, 8], [1, 2, 3], [100, 200, 300]])
    vocab = 37
    u = noise_uniforms(seeds, positions, vocab)
    assert u.dtype == torch.float64 and u.shape == (8, 3, vocab)
    want = torch.tensor([[[reference_uniform(s, p, t) for t in range(vocab)] for p in row]
                         for s, row in zip(seeds, positions.tolist())], dtype=torch.float64)
    assert torch.equal(u, want)
    # seeds are taken mod 2^64, as lists or tensors
    assert torch.equal(noise_uniforms(seed_tensor(seeds, "cpu"), positions, vocab), u)
    assert torch.equal(noise_uniforms([3], positions[:1], vocab), noise_uniforms([2 ** 64 + 3], positions[:1], vocab))


def test_uniforms_are_uniform_and_independent():
    """KS against U(0, 1) on 96k draws, and chi-square of pairs on a 10 x 10 grid: neighbouring tokens, neighbouring
    positions, neighbouring seeds. The pair test rejects a generator that reuses a stream (its power check)."""
    seeds, positions = list(range(6)), torch.arange(16).expand(6, 16)
    u = noise_uniforms(seeds, positions, 1000)  # [6, 16, 1000]
    assert kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3

    def pair_pvalue(a, b):
        cells = (a * 10).long() * 10 + (b * 10).long()
        counts = torch.bincount(cells.flatten(), minlength=100).double()
        return chisquare(counts.numpy()).pvalue

    assert pair_pvalue(u[:, :, :-1], u[:, :, 1:]) > 1e-3  # tokens
    assert pair_pvalue(u[:, :-1], u[:, 1:]) > 1e-3  # positions
    assert pair_pvalue(u[:-1], u[1:]) > 1e-3  # seeds
    assert pair_pvalue(u[:, :-1], u[:, :-1]) < 1e-6  # the same stream twice


def test_noise_is_finite_and_independent_of_the_batch():
    # the extreme words, all zero bits and all one bits, give u = 2^-53 and 1 - 2^-53: finite Gumbel values
    u = _open_unit(torch.tensor([0, -1]))
    assert u.tolist() == [2.0 ** -53, 1 - 2.0 ** -53] and (-torch.log(-torch.log(u))).isfinite().all()
    positions = torch.tensor([[5, 6, 7], [40, 41, 42], [0, 1, 2]])
    batch = gumbel_noise([9, 3, 9], positions, 50)
    assert batch.dtype == torch.float32 and batch.isfinite().all()
    for row, (seed, pos) in enumerate(zip([9, 3, 9], positions)):
        assert torch.equal(batch[row], gumbel_noise([seed], pos[None], 50)[0])
    assert not torch.equal(batch[0], batch[2])  # same seed, other positions
    assert not torch.equal(gumbel_noise([9], positions[1:2], 50), batch[1:2])  # same positions, other seed
    # Gumbel law: mean = Euler's constant, variance pi^2 / 6 (1.6449), on 6 * 16 * 1000 draws
    g = gumbel_noise(list(range(6)), torch.arange(16).expand(6, 16), 1000).double()
    assert abs(g.mean().item() - 0.5772) < 0.02 and abs(g.var().item() - 1.6449) < 0.05
