"""Regeneration through a serving engine: any OpenAI-compatible server (vLLM, SGLang, this project's Serve app).

`--regenerate-with openai:http://host:port/v1` makes the extraction actors send each turn's prompts to the
server as token ids (`/v1/completions`, so the server applies no chat template of its own: the prompt is
exactly the one the in-actor path would generate from), many requests in flight, with retries. Regenerated
shards are committed as with in-actor regeneration (`regenerated/<shard>.jsonl`), so a rerun resumes per
shard. `OPENAI_API_KEY`, when set, is sent as the bearer token.
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

OPENAI_PREFIX = "openai:"


def parse_regenerate_with(value: str) -> str | None:
    """'hf' -> None (the target in the actor); 'openai:URL' -> the server's base URL (ending in /v1)."""
    if value == "hf":
        return None
    if value.startswith(OPENAI_PREFIX) and value[len(OPENAI_PREFIX):].startswith(("http://", "https://")):
        url = value[len(OPENAI_PREFIX):].rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"
    raise ValueError(f"--regenerate-with must be 'hf' or 'openai:http(s)://host:port[/v1]', got {value!r}")


class ServerError(RuntimeError):
    pass


@dataclass
class OpenAIReplies:
    """`replies(prompts, seed)` for `eagle_core.features.regenerate_conversations`, answered by a server."""

    base_url: str
    max_tokens: int
    temperature: float = 0.0
    model: str | None = None  # None: the first model the server lists
    concurrency: int = 32
    retries: int = 6
    timeout: float = 600.0

    def __post_init__(self):
        import httpx

        key = os.environ.get("OPENAI_API_KEY")
        self._client = httpx.Client(base_url=self.base_url, timeout=self.timeout,
                                    headers={"Authorization": f"Bearer {key}"} if key else {},
                                    limits=httpx.Limits(max_connections=self.concurrency))

    def __call__(self, prompts: list[list[int]], seed: int) -> list[str]:
        if self.model is None:
            self.model = self._request("GET", "/models")["data"][0]["id"]
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda item: self._reply(item[1], seed + item[0]), enumerate(prompts)))

    def _reply(self, prompt: list[int], seed: int) -> str:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "seed": seed}
        return self._request("POST", "/completions", body)["choices"][0]["text"].strip()

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        """One call, retried with jittered exponential backoff on connection errors, 429 and 5xx."""
        import httpx

        for attempt in range(self.retries + 1):
            try:
                response = self._client.request(method, path, json=body)
            except httpx.TransportError as err:
                problem = f"{type(err).__name__}: {err}"
            else:
                if response.status_code < 400:
                    return response.json()
                problem = f"HTTP {response.status_code}: {response.text[:500]}"
                if response.status_code != 429 and response.status_code < 500:
                    raise ServerError(f"{self.base_url}{path} refused the request: {problem}")
            if attempt < self.retries:
                time.sleep(min(30.0, 0.5 * 2 ** attempt) * (0.5 + random.random()))
        raise ServerError(f"{self.base_url}{path} failed after {self.retries + 1} attempts: {problem}")
