"""Sampling noise that needs neither a generator nor the host, and decoding timers that never wait for the device.

Noise (`eagle_core.verify.noise_uniforms` / `gumbel_noise`): SplitMix64 in int64 tensor arithmetic equals the
published algorithm and a pure-Python (arbitrary-precision integer) reference bit for bit, so every device that wraps
int64 arithmetic gives the same bits; its uniforms are uniform and independent across tokens, positions and seeds;
the Gumbel noise is always finite; a row's noise does not depend on its batch.

Timers (`eagle_core.timing`): decoding, the auto-tune and the round profile only mark times inside a round and read
them after it (what lets CUDA events replace synchronisation), with marks the code cannot do arithmetic on, on a
deterministic tick clock: the times add up exactly.
"""

import pytest
import torch
from scipy.stats import chisquare, kstest

import bench.rounds as rounds
import eagle_core.autotune as autotune
import eagle_core.decoding as decoding
import eagle_core.generate as generate_module
from decode_helpers import damped_tiny_llama, echo_draft, random_prompts, single_thread  # noqa: F401 (autouse fixture)
from eagle_core.generate import generate
from eagle_core.timing import CudaTimer, Timer, timer_for
from eagle_core.tree import TreeConfig
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


# ---- timers ------------------------------------------------------------------------------------------------------

class Mark:
    """An opaque mark (as a CUDA event is): code that subtracts marks instead of asking the timer fails."""

    def __init__(self, tick):
        self.tick = tick


class TickTimer(Timer):
    """Every mark is one tick (a second) after the last; `log` records marks and reads in order."""

    def __init__(self):
        self.ticks, self.log = 0, []

    def mark(self):
        self.ticks += 1
        self.log.append("mark")
        return Mark(self.ticks)

    def seconds(self, start, end) -> float:
        self.log.append("read")
        return float(end.tick - start.tick)


@pytest.fixture
def tick_timer(monkeypatch):
    timer = TickTimer()
    for module in (decoding, generate_module, autotune, rounds):
        monkeypatch.setattr(module, "timer_for", lambda device: timer)
    return timer


@pytest.fixture(scope="module")
def models():
    target = damped_tiny_llama(0.5, dtype=torch.float32, seed=3)
    return target, echo_draft(target)


TREE = TreeConfig(4, 2, 6, context_chain=5)


def test_the_cpu_timer_is_the_host_clock():
    timer = timer_for("cpu")
    assert type(timer) is Timer and type(timer_for("cuda:0")) is CudaTimer  # choosing one touches no GPU
    a = timer.mark()
    b = timer.mark()
    assert timer.seconds(a, b) == b - a >= 0.0


def test_rounds_mark_inside_and_read_after(models, tick_timer):
    """Each round marks its phases and reads the times only once it has returned its tokens, and a round's times add up
    to the span between its first and last mark (draft = catch-up + lookup + tree + draft extension)."""
    target, draft = models
    prompts = [p * 3 for p in random_prompts(2, 512, lo=6, hi=10, seed=5)]
    state, first = decoding.DecodingState.prefill(target, draft, prompts, decoding.SamplingConfig(0.7), TREE,
                                                  seeds=[1, 2])
    assert first.seconds == 1.0  # one tick from the prefill's first mark to its last
    for mode in ("plain", "plain", "context", "tree", "chain", "plain"):
        tick_timer.log.clear()
        start = tick_timer.ticks
        step = state.step(mode)
        marks = tick_timer.log.count("mark")
        assert tick_timer.log == ["mark"] * marks + ["read"] * (len(tick_timer.log) - marks), mode
        assert step.seconds == tick_timer.ticks - start - 1, mode  # the first mark is a tick after `start`
    tree_step = state.step("tree")  # after a plain step: the deferred catch-up is timed and counted in the draft
    assert tree_step.catch_up_s == 1.0 and tree_step.round_seconds == tree_step.seconds - 1.0
    assert tree_step.verify_s == 1.0 and tree_step.draft_s == 4.0  # catch-up, lookup, tree, extension: a tick each


def test_generate_and_the_round_profile_add_up_on_a_tick_clock(models, tick_timer):
    """The profile reads a round's marks when the round ends, and its exclusive phase times sum exactly to the rounds'
    spans (no phase counted twice, none lost)."""
    target, draft = models
    prompts = [p * 3 for p in random_prompts(2, 512, lo=6, hi=10, seed=5)]
    spans = []
    with rounds.PhaseTimer("cpu") as profile:
        read_round = profile.read_round

        def reading():  # the round's own frame ("bookkeeping", DecodingState.step) is the last one to end
            mode, phase, start, end, _ = profile.pending[-1]
            assert phase == "bookkeeping" and tick_timer.log[-1] == "mark"
            spans.append(end.tick - start.tick)
            read_round()
        profile.read_round = reading
        res = generate(target, prompts, draft=draft, tree=TREE, max_new_tokens=12, mode="context")
    n = profile.rounds["context"]
    assert n == max(st.rounds for st in res.stats) == len(spans) and not profile.pending
    assert sum(profile.per_round("context").values()) * n == pytest.approx(1000 * sum(spans))
    s = res.stats[0]
    assert s.total_s >= s.prefill_s + s.draft_s + s.verify_s > 0


def test_the_auto_tune_marks_every_case_and_reads_at_the_end(tick_timer):
    """Case k advances the clock by k ticks (marks inside it), so its median is k + 1 ticks; no time is read before
    the last case ran."""
    cases = {k: (lambda k=k: [tick_timer.mark() for _ in range(k)], None) for k in (0, 2, 5)}
    ms = autotune.interleaved_ms("cpu", cases, repeats=3)
    assert ms == {0: 1000.0, 2: 3000.0, 5: 6000.0}
    first_read = tick_timer.log.index("read")
    assert "mark" not in tick_timer.log[first_read:]
