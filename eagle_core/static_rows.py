"""The static layout both static caches share (`eagle_core.static_kv`: the target's `StaticKV`, the draft's
`StaticDraftKV`): preallocated buffers written by index, per-row lengths on the device, in-place keeps, row
selections and merges, and the buckets that keep a compiled step's shapes fixed.

Layout: row b's committed entries occupy slots [0, lengths[b]) and slot s holds position s (as in `eagle_core.kv`).
A forward of S new tokens writes them at slots [lengths[b], lengths[b] + S) of each row (a scatter: rows write at
their own slots; a draft tree's later levels after its earlier ones) with the positions the caller gives;
`keep_new_` moves the kept ones down to [lengths[b], lengths[b] + n_keep[b]) in place and adds n_keep to the
lengths. A plain step's one entry already sits where it is kept: the step only adds 1. Nothing is reallocated:
every buffer keeps the `data_ptr()` of its allocation across rounds, row selections (`select_rows_`) and merges
(`merge_`).

Attention reads the first `attend_width` slots of every buffer: a multiple of `bucket` at least the host's bound on
the longest row plus what the forward adds, so a compiled step sees the same shapes until the bucket changes. Slots
a row does not own are masked out, so what they hold changes no token (the tests write garbage there); it must only
be finite (a NaN times a zero weight is NaN), which zero-filled buffers written with the model's own keys are.

Every step (and the draft loop) runs on the batch's `ROW_BUCKETS` rows (`step_rows`: at most the rows allocated):
padding rows are spare rows, emptied (length 0) before the step and fed copies of the last real row's inputs, so
they write only slots [0, S) of their own rows, which no row owns, and what they compute is cut off. Rows leaving
and joining within one bucket change no shape a compiled step sees.

The host keeps a few ints per cache (`width`: an upper bound on the longest row, advanced by what a keep may add,
its K; `pending`; `attend_width`), never read from the device. A step that fails to compile or capture runs
uncompiled (`StaticRows._compiled`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

log = logging.getLogger("eagle_core.static_kv")  # the static path's one logger, whichever module logs

# A verified tree is padded to the first of these node counts it fits: trees of one bucket share one compiled verify
# step (a context chain's length, a draft's size vary from round to round). `DecodingState` hands a wider verify to
# the eager cache; called directly, a wider one runs at its own width.
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)
# A batch's compiled steps run on the first of these row counts it fits (at most the rows allocated): rows leaving
# and joining inside one bucket change no shape the steps see. `DecodingState` hands a larger batch to the eager cache.
ROW_BUCKETS = (1, 2, 4, 8, 16)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next((w for w in buckets if w >= n), n)


def verify_width(n: int) -> int:
    """The node count a tree of n nodes is verified at: its `WIDTH_BUCKETS` width, or n past the widest (>= n)."""
    return _bucket(n, WIDTH_BUCKETS)


def step_rows(n: int, allocated: int) -> int:
    """The rows the steps of a batch of n rows run on: its `ROW_BUCKETS` bucket, at most the `allocated` rows of
    its buffers (>= n), or n past the largest bucket."""
    return min(_bucket(n, ROW_BUCKETS), max(n, allocated))


def pad_rows(x: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """x [B, ...] with rows - B padding rows after its own, copies of its last (valid ids, finite values: what a
    padding row computes is never read back); None stays None."""
    if x is None or x.shape[0] == rows:
        return x
    return torch.cat([x, x[-1:].expand(rows - x.shape[0], *x.shape[1:])])


def first_rows(out, b: int):
    """A step's output (a `Tree`, an `Acceptance`) with its tensors cut to the batch's b real rows."""
    return replace(out, **{f.name: getattr(out, f.name)[:b] for f in fields(out)
                           if isinstance(getattr(out, f.name), torch.Tensor)})


class CacheFull(RuntimeError):
    """A forward would write past the cache's capacity (slots per row) or a merge past its rows."""


# Slots an uncompiled step's attention reads at a time (`StaticConfig.bucket`'s default where nothing is compiled).
EAGER_BUCKET = 64


@dataclass
class StaticConfig:
    capacity: int = 2048  # slots per row: prompt, answer and one verify's tree
    rows: int = 0  # batch rows allocated (0: the prefill's batch); merges fill the spare ones
    # Attention reads a multiple of this many slots. None: the whole capacity when the steps are compiled (a mask over
    # the whole cache, as gpt-fast's: one shape for every cache length, so one compile and one CUDA graph per step,
    # row bucket and verify width, never one per length), `EAGER_BUCKET` slots when they run eagerly (less to read).
    bucket: int | None = None
    # Wraps the plain step, the verify step and the draft loop once each (`inductor()`, or e.g. `lambda f:
    # torch.compile(f, fullgraph=True, backend="eager")`); None: eager.
    compile: Callable | None = None

    @property
    def attention_bucket(self) -> int:
        if self.bucket is not None:
            return self.bucket
        return self.capacity if self.compile is not None else EAGER_BUCKET


def inductor(mode: str | None = None) -> Callable:
    """The compile of `StaticConfig.compile` for decoding: `torch.compile(fullgraph=True, dynamic=False)` (one graph
    per step, shapes fixed by the buckets), with torch's persistent caches kept once per machine under the project's
    cache folder (`compile_cache_dir`): a second process (another replica, the next job) loads the compiled kernels
    instead of generating them again."""
    compile_cache_dir()
    return lambda step: torch.compile(step, fullgraph=True, dynamic=False, mode=mode)


def compile_cache_dir():
    """Where torch keeps what it compiled: Inductor's FX graph cache (the generated C++/Triton kernels, keyed by the
    graph and the machine) and AOTAutograd's cache, both on by default, under TORCHINDUCTOR_CACHE_DIR; unset, it is
    set to `<EAGLE3_CACHE>/torch-compile` (the folder that also keeps the converted targets, a volume a cluster's
    nodes keep across pods) instead of torch's /tmp/torchinductor_<user>. Dynamo's tracing is not cached: each
    process traces its steps again (seconds), then finds the compiled graphs."""
    import os

    from eagle_core.target import cache_dir

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if folder in (None, "", default_cache_dir()):  # unset, or set by torch itself to its default when first asked
        folder = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "torch-compile")
    return folder


class StaticRows:
    """Preallocated cache tensors of one or more layers and every row's length, changed in place only: what the
    target's `StaticKV` and the draft's `StaticDraftKV` share (writes, keeps, rows leaving and joining).

    `pending` (host): entries written past the committed ones since the last keep (a draft tree's levels); row
    b's pending entry e sits at slot lengths[b] + e."""

    def __init__(self, layers: int, shape: tuple, weight: torch.Tensor, batch_size: int, config: StaticConfig):
        self.keys = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in range(layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self._lengths = torch.zeros(shape[0], dtype=torch.long, device=weight.device)  # [rows]
        for t in self.buffers():  # a compiled step may rely on their addresses (CUDA graphs read and write them)
            torch._dynamo.mark_static_address(t)
        self.batch, self.config = batch_size, config
        self.width = 0  # host: upper bound on every row's length
        self.pending = 0
        self.attend_width = 0  # slots the current forward's attention reads

    @property
    def lengths(self) -> torch.Tensor:
        """[B] the rows' lengths: a view of the cache's own tensor, changed in place by every keep (inside a step,
        `_padded_rows`, the bucket's rows)."""
        return self._lengths[: self.batch]

    @contextmanager
    def _padded_rows(self):
        """While a step runs on the batch's row bucket (`step_rows`): the cache acts as a batch of that many rows,
        the padding ones (spare rows [batch, bucket)) emptied first (length 0), so that they see and write only
        slots [0, S) of their own rows, which no row owns. Yields (the batch's rows, the bucket's)."""
        b = self.batch
        rows = step_rows(b, self._lengths.shape[0])
        self._lengths[b:rows] = 0
        self.batch = rows
        try:
            yield b, rows
        finally:
            self.batch = b

    def buffers(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values, self._lengths]

    def _compiled(self, step: Callable, name: str) -> Callable:
        """`step` through `StaticConfig.compile` (as is without one). When compiling or capturing it fails (out of
        memory in a CUDA graph's capture, an op the compiler cannot take), this cache runs `step` uncompiled from
        then on, with the same tokens: the rows' lengths are put back as they were before the failed call (a
        capture's warm-up may have run the step), the call is repeated, and one log line says why."""
        if self.config.compile is None:
            return step
        compiled = [self.config.compile(step)]

        def run(*args):
            if compiled[0] is step:
                return step(*args)
            lengths = self._lengths.clone()
            try:
                return compiled[0](*args)
            except CacheFull:
                raise
            except Exception as err:  # noqa: BLE001 - any failure of the compiler or the capture: run it eagerly
                self._lengths.copy_(lengths)
                compiled[0] = step
                log.warning("static decoding runs its %s uncompiled: compiling or capturing it failed (%s)", name,
                            f"{type(err).__name__}: {err}"[:300])
                return step(*args)
        return run

    def no_room(self, n_new: int) -> str | None:
        """Why n_new entries past the committed ones do not fit (a forward would raise `CacheFull`), or None."""
        if self.width + n_new > self.config.capacity:
            return (f"{n_new} new entries past the {self.width} slots in use exceed its {self.config.capacity} "
                    "(StaticConfig.capacity)")
        return None

    def can_merge(self, other) -> bool:
        """Whether `merge_(other)` fits: a cache of the same kind and layers, into the spare rows and slots."""
        return (type(other) is type(self) and len(other.keys) == len(self.keys)
                and self.batch + other.batch <= self._lengths.shape[0] and other.width <= self.config.capacity)

    def _reserve(self, n_new: int) -> None:
        """Before a forward that leaves n_new entries past the committed ones: check the room, choose the slots
        attention reads (the bucket)."""
        need, capacity, bucket = self.width + n_new, self.config.capacity, self.config.attention_bucket
        if need > capacity:
            raise CacheFull(f"{n_new} new entries need up to {need} slots per row; the static cache has "
                            f"{capacity} (StaticConfig.capacity)")
        self.attend_width = min(capacity, -(-need // bucket) * bucket)

    def _allowed(self, new_mask: torch.Tensor) -> tuple:
        """(allowed [B, S, W], committed [B, W], e [B, W]) over the W = attend_width slots: row b's query i sees its
        committed slots (< lengths[b]) and the entries past them that new_mask [B, S, E] allows (entry e at slot
        lengths[b] + e); e is each slot's entry index, clamped into [0, E)."""
        b, s, n = new_mask.shape
        slot = torch.arange(self.attend_width, device=new_mask.device)[None, :]  # [1, W]
        rel = slot - self._lengths[:b, None]  # [B, W]: e for the new entries, < 0 for the committed ones
        committed = rel < 0
        e = rel.clamp(0, n - 1)
        is_new = ~committed & (rel < n)
        allowed = committed[:, None, :] | (is_new[:, None, :] & new_mask.gather(2, e[:, None, :].expand(b, s, -1)))
        return allowed, committed, e

    def _write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write (k, v) [B, kv, S, d] at every row's slots lengths[b] + pending + [0, S); return the slots attention
        reads, [B, kv, attend_width, d]."""
        b, _, s, _ = key_states.shape
        slots = self._lengths[:b, None] + self.pending + torch.arange(s, device=key_states.device)  # [B, S]
        index = slots[:, None, :, None].expand_as(key_states)
        keys, values = self.keys[layer][:b], self.values[layer][:b]
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        return keys[:, :, : self.attend_width], values[:, :, : self.attend_width]

    def keep_new_(self, past_width, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        """After a forward of S entries: keep `keep[b, :n_keep[b]]` of them (indices into the new entries), moved
        in order to slots [lengths[b], lengths[b] + n_keep[b]). `past_width` is the growing caches' and unused: rows
        wrote at their own lengths. Every row moves K = keep.shape[1] entries (those past n_keep land in its
        garbage), read before any is written."""
        self._keep(keep, n_keep)
        self.width += keep.shape[1]
        self.pending = 0

    def _keep(self, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        b, k = keep.shape
        lengths = self._lengths[:b]
        src = lengths[:, None] + keep  # [B, K]
        dst = lengths[:, None] + torch.arange(k, device=keep.device)
        for buf in (*self.keys, *self.values):
            rows = buf[:b]
            shape = (b, buf.shape[1], k, buf.shape[3])
            moved = rows.gather(2, src[:, None, :, None].expand(shape))
            rows.scatter_(2, dst[:, None, :, None].expand(shape), moved)
        lengths += n_keep

    def truncate_(self, width: int) -> None:
        """Forget every slot from `width` on (rows' lengths capped at it) and the pending entries (they lie past
        the lengths already)."""
        self.lengths.clamp_(max=width)
        self.width, self.pending = min(self.width, width), 0

    def select_rows_(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` ([B'] long, in order): moved to rows [0, B') of the same buffers."""
        n, w = rows.numel(), self.width
        for buf in (*self.keys, *self.values):
            buf[:n, :, :w] = buf[rows, :, :w]  # the right side is a new tensor: read before anything is written
        self._lengths[:n] = self._lengths[rows]
        self.batch = n

    def merge_(self, other: "StaticRows") -> None:
        """Append `other`'s rows after this cache's rows, into its spare rows (`StaticConfig.rows`). Checked before
        anything is copied: a merge that cannot fit leaves this cache as it was."""
        if not self.can_merge(other):
            raise CacheFull(f"merging {other.batch} rows of up to {other.width} slots into a static cache of "
                            f"{self._lengths.shape[0]} rows ({self.batch} in use) and {self.config.capacity} slots")
        n, m, w = self.batch, other.batch, other.width
        for mine, theirs in zip((*self.keys, *self.values), (*other.keys, *other.values)):
            mine[n: n + m, :, :w] = theirs[:m, :, :w]
        self._lengths[n: n + m] = other.lengths
        self.batch, self.width = n + m, max(self.width, w)
