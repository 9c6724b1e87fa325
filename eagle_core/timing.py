"""Timing without synchronising the device: marks now, seconds between them later.

Decoding, the auto policy, the auto-tune and the round profile time their phases with a `Timer`: `mark()` where a
phase starts or ends, `seconds(start, end)` where a number is needed. On the CPU a mark is `time.perf_counter()`
(host and device are one). On CUDA it is an event recorded on the current stream: recording does not wait for the
GPU, so the phases of a round queue up back to back as they would untimed, and the GPU's own timeline says when
each mark was reached. `seconds` waits for its end mark, so callers read it only once the host has waited for
that work anyway (after a round's tokens came back with `.tolist()`): then it costs nothing.
"""

from __future__ import annotations

import time

import torch


class Timer:
    """Host clock: a mark is `time.perf_counter()`. The CPU's timer, and the interface of every timer."""

    def mark(self):
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        """Seconds from mark `start` to mark `end`."""
        return end - start

    def settle(self) -> None:
        """Wait until the device's queued work is done (outside any timed span: a case starting on an idle
        device, as every decoding round does after the host read the last one's tokens)."""


class CudaTimer(Timer):
    """Device clock: a mark is a CUDA event recorded on the current stream, read when `seconds` is asked."""

    def __init__(self, device):
        self.device = torch.device(device)

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start, end) -> float:
        end.synchronize()  # immediate where the host already waited for this work (see the module doc)
        return start.elapsed_time(end) / 1000.0

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)


def timer_for(device) -> Timer:
    """The timer of a device: CUDA events on a GPU, perf_counter elsewhere."""
    return CudaTimer(device) if torch.device(device).type == "cuda" else Timer()


def clock(device) -> float:
    """Seconds (perf_counter) once the device's queued work is done: for benchmarks timing whole calls. Decoding,
    the auto policy and the auto-tune use a `Timer` instead, which never waits for the device."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
