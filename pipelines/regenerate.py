"""Regeneration through a serving engine: any OpenAI-compatible server (vLLM, SGLang, this project's Serve app).

`--regenerate-with openai:http://host:port/v1` makes the extraction actors send each turn's prompts to the
server as token ids (`/v1/completions`, so the server applies no chat template of its own: the prompt is
exactly the one the in-actor path would generate from), many requests in flight, with retries. Regenerated
shards are committed as with in-actor regeneration (`regenerated/<shard>.jsonl`), so a rerun resumes per
shard. `OPENAI_API_KEY`, when set, is sent as the bearer token.

The server must serve the target, or the "regenerated" answers are another model's. Before the first request
`check_target` picks the served model and checks it: a listed model named like the target (its path or hub
name, last path component, case-insensitive) is taken as the target; otherwise the model given after `#`
(`openai:http://host:8000/v1#my-served-name`), or the only one listed, must pass a probe: greedy continuations
of a few prompts, sent as the target's token ids, must begin as the target's own do. A reply cut at max_tokens
(`finish_reason: "length"`) comes back marked truncated; `regenerate_conversations` decides what to keep.
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import PurePosixPath

from eagle_core.features import Reply

OPENAI_PREFIX = "openai:"
# Prompts of the target probe: short, ordinary questions whose greedy continuations start deterministically.
PROBE_QUESTIONS = ("What is the capital of France?", "Write one word that rhymes with cat.",
                   "Count from one to five.")
PROBE_TOKENS = 4


def parse_regenerate_with(value: str) -> str | None:
    """'hf' -> None (the target in the actor); 'openai:URL[#MODEL]' -> the server's base URL (ending in /v1),
    with '#MODEL' kept when given (the fragment is never sent to the server)."""
    if value == "hf":
        return None
    if value.startswith(OPENAI_PREFIX) and value[len(OPENAI_PREFIX):].startswith(("http://", "https://")):
        url, _, model = value[len(OPENAI_PREFIX):].partition("#")
        url = url.rstrip("/")
        url = url if url.endswith("/v1") else url + "/v1"
        return f"{url}#{model}" if model else url
    raise ValueError(f"--regenerate-with must be 'hf' or 'openai:http(s)://host:port[/v1][#served-model]', "
                     f"got {value!r}")


def _short(name: str) -> str:
    return PurePosixPath(str(name).rstrip("/")).name.lower()


def target_names(model, tokenizer) -> set[str]:
    """Names the target goes by: its config's and tokenizer's paths or hub ids, their last path components, and
    the hub model a short target name was made from."""
    from eagle_core.checkpoint import RESOLVABLE_VERIFIERS

    names = set()
    for name in (getattr(getattr(model, "config", None), "_name_or_path", ""), getattr(tokenizer, "name_or_path", "")):
        if name:
            names |= {str(name).lower(), _short(name)}
    for short, hub in RESOLVABLE_VERIFIERS.items():
        if short in names:
            names |= {hub.lower(), _short(hub)}
    return names


def named_like(served: str, names: set[str]) -> bool:
    """A served model id names the target: equal, or equal in its last path component (this project's Serve app
    serves `<target>-eagle3` when a draft is attached)."""
    served = served.lower()
    short = _short(served).removesuffix("-eagle3")
    return served in names or short in names


class ServerError(RuntimeError):
    pass


@dataclass
class OpenAIReplies:
    """`replies(prompts, seed)` for `eagle_core.features.regenerate_conversations`, answered by a server."""

    base_url: str  # may end in "#MODEL" (parse_regenerate_with), naming the served model to use
    max_tokens: int
    temperature: float = 0.0
    model: str | None = None  # None: the listed model named like the target, or the only one (check_target)
    concurrency: int = 32
    retries: int = 6
    timeout: float = 600.0

    def __post_init__(self):
        import httpx

        self.base_url, _, named = self.base_url.partition("#")
        self.model = self.model or named or None
        self._checked = False
        key = os.environ.get("OPENAI_API_KEY")
        self._client = httpx.Client(base_url=self.base_url, timeout=self.timeout,
                                    headers={"Authorization": f"Bearer {key}"} if key else {},
                                    limits=httpx.Limits(max_connections=self.concurrency))

    def __call__(self, prompts: list[list[int]], seed: int) -> list[Reply]:
        if self.model is None:
            raise ServerError(f"{self.base_url}: no model chosen; call check_target(model, tokenizer) first "
                              "(regenerate_conversations does) or pass model=")
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda item: self._reply(item[1], seed + item[0]), enumerate(prompts)))

    def _completion(self, prompt: list[int], max_tokens: int, temperature: float, seed: int | None) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            body["seed"] = seed
        return self._request("POST", "/completions", body)["choices"][0]

    def _reply(self, prompt: list[int], seed: int) -> Reply:
        choice = self._completion(prompt, self.max_tokens, self.temperature, seed)
        return Reply(choice["text"].strip(), choice.get("finish_reason") == "length")

    def check_target(self, model, tokenizer) -> None:
        """Choose the served model and make sure it is the target `model` (with `tokenizer`); once per client.

        Raises ServerError naming what the server lists and what to do."""
        if self._checked:
            return
        listed = [m["id"] for m in self._request("GET", "/models").get("data", [])]
        names = target_names(model, tokenizer)
        if self.model is not None and self.model not in listed:
            raise ServerError(f"{self.base_url} does not serve {self.model!r}; it lists {listed}")
        if self.model is None:
            alike = [m for m in listed if named_like(m, names)]
            self.model = alike[0] if alike else listed[0] if len(listed) == 1 else None
        if self.model is None:
            raise ServerError(f"{self.base_url} lists {listed}, none named like the target ({sorted(names)}): name the "
                              "served target as --regenerate-with openai:URL#MODEL")
        if not named_like(self.model, names):
            agreed, seen = self.probe(model, tokenizer)
            if agreed * 2 <= len(seen):
                raise ServerError(
                    f"{self.base_url} serves {self.model!r}, which is not named like the target ({sorted(names)}) and "
                    f"does not continue the target's token ids as the target does ({agreed}/{len(seen)} probes "
                    f"agree: {seen}); regenerate with a server that serves the target (e.g. vLLM's "
                    "--served-model-name set to the target's name), or with 'hf'")
        self._checked = True

    def probe(self, model, tokenizer) -> tuple[int, list[tuple[str, str]]]:
        """(probes agreeing, [(target's text, server's text)]): greedy continuations of `PROBE_QUESTIONS`, sent as the
        target's token ids, agree when the server's text begins with the target's first generated token that is
        not whitespace (the first only, so that bf16 and fp32 engines agree on a target they both serve)."""
        from eagle_core.chat import prompt_ids
        from eagle_core.features import generate_ids

        if getattr(tokenizer, "chat_template", None):
            prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in PROBE_QUESTIONS]
        else:
            prompts = [tokenizer(q, add_special_tokens=False)["input_ids"] for q in PROBE_QUESTIONS]
        ours = generate_ids(model, tokenizer, prompts, PROBE_TOKENS, 0.0, 0)
        agreed, seen = 0, []
        for prompt, ids in zip(prompts, ours):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            lead = next((tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(1, len(ids) + 1)
                         if tokenizer.decode(ids[:k], skip_special_tokens=True).strip()), "")
            try:
                served = self._completion(prompt, PROBE_TOKENS, 0.0, None)["text"]
            except ServerError as err:  # e.g. token ids outside the served model's vocabulary
                served = f"<refused: {err}>"
            agreed += served == text or (bool(lead) and served.startswith(lead))
            seen.append((text, served))
        return agreed, seen

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
