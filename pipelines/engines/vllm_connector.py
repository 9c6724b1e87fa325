"""The KV connector through which the `vllm` engine receives hidden states: vLLM's `ExampleHiddenStatesConnector`
(a request's aux layers' hidden states, kept by the `extract_hidden_states` speculative method in a cache-only
attention layer, written to one safetensors file per request when the request finishes), made to run on vLLM's
CPU backend as well.

vLLM 0.32's connector copies through CUDA streams and pinned host memory, which its CPU build cannot allocate
("pin_memory=True requires a CUDA or other accelerator backend"). Where the cache lives on the host this one
gathers the request's slots and writes the file on the connector's writer threads, releasing the request's
lock when the file is complete; on a GPU it is vLLM's own path, unchanged. Loaded by module path
(`kv_connector_module_path`), so vLLM itself is not patched.
"""

from __future__ import annotations

import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Copied:
    """A copy that finished when it was made (host to host): what `get_finished` polls with `query()`."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.device.type == "cuda":
            return super()._submit_async_write(pending)
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size, dtype=torch.long)[None, :] + blocks[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        copied = _Copied()
        future = self._executor.submit(self._write_tensors, tensors, copied, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = copied
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, req_id=pending.req_id: self._on_write_done(req_id, f))
