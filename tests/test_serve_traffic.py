"""The traffic sink wired into serving (issue 43, part 2): one replica's routes (`Routes` over a real `Service`, as
the deployment wires them) on uvicorn, the tiny damped target and the echo draft from a folder, fp32 on the CPU.

Properties:
- With `traffic_url` set, the replica answers exactly what a replica with the sink off answers (same text, same
  token counts), and writes shards whose rows' input_ids are prompt + answer as served (equal to transformers'
  greedy continuation of the prompt: the server is lossless), whose loss mask covers the answer (and, for a chat,
  what the template marks), and whose features equal a fresh capture (`eagle_core.capture.capture_features`) of
  those ids within 1e-5 relative per position (a final token that was a bonus no forward processed is zeros); each
  row's category label is in its shard's summary (`row_meta`, `categories`); every prefill of that replica ran
  with capture; /metrics counts what was offered and written.
- With the sink off: no sink object, no prefill with capture, no traffic_* metric, nothing written.
- A store that fails every write (the URL lies under a regular file) loses no request: every request answers 200,
  and /metrics counts each record dropped with reason "store_error".
"""

import concurrent.futures
import json

import pyarrow.parquet as pq
import pytest
import torch

from decode_helpers import echo_draft, single_thread  # noqa: F401 (autouse: 1 torch thread in this process)
from serve_helpers import metric, replica_app, save_target, uvicorn_thread

MODEL = "tiny-traffic"
PROMPTS = ["Once upon a time", "def f(x):", "The quick brown fox jumps over", "Hello"]
CHAT = [{"role": "user", "content": "Name a color."}]
FP32_REL = 1e-5
PREFILLS: list = []  # (target, capture) of every DecodingState.prefill while a replica of this module decodes


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer):
    from eagle_core.checkpoint import save_draft
    from eagle_core.target import load_target

    target_dir = save_target(tmp_path_factory.mktemp("traffic-target"), smollm2_tokenizer)
    target, tokenizer = load_target(str(target_dir), device="cpu", dtype=torch.float32)
    draft_dir = tmp_path_factory.mktemp("traffic-draft")
    save_draft(echo_draft(target), draft_dir)
    return str(target_dir), str(draft_dir), target, tokenizer


@pytest.fixture(autouse=True)
def spy_prefill(monkeypatch):
    """Records whether each prefill captured features (and for which replica's target)."""
    from eagle_core.decoding import DecodingState

    real = DecodingState.prefill.__func__

    def prefill(cls, target, *args, capture=None, **kwargs):
        PREFILLS.append((target, capture))
        return real(cls, target, *args, capture=capture, **kwargs)

    monkeypatch.setattr(DecodingState, "prefill", classmethod(prefill))
    PREFILLS.clear()


def start(models, **traffic):
    from pipelines.serve.config import ServeConfig
    from pipelines.serve.service import Service

    target_dir, draft_dir = models[:2]
    return Service(ServeConfig(target=target_dir, draft=draft_dir, model_name=MODEL, dtype="float32", device="cpu",
                               top_k=4, depth=4, total_tokens=12, mode_policy="static", tree_max_batch=4,
                               max_context=256, max_tokens_limit=64, torch_threads=1, **traffic))


def ask(url) -> list[dict]:
    """The same requests to a replica: completions with a header or body label (three at once: a ragged batch),
    then a chat. Returns the response bodies in PROMPTS order, the chat last."""
    import httpx

    def one(i):
        body = {"prompt": PROMPTS[i], "max_tokens": 10 + i, "temperature": 0}
        kwargs = {"headers": {"x-eagle3-category": "code"}} if i % 2 else {}
        if i == 2:
            body["category"] = "story"
        with httpx.Client(base_url=url, timeout=120) as c:
            r = c.post("/v1/completions", json=body, **kwargs)
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        out = list(pool.map(one, range(len(PROMPTS))))
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return out + [r.json()]


def answer_text(body: dict) -> str:
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def read_rows(url: str) -> tuple[list[dict], list[dict]]:
    """Every committed row of the sink's output (its `features/` shards) and the shards' summaries."""
    from pathlib import Path

    from pipelines.feature_files import SHARD_META_KEY

    rows, summaries = [], []
    for path in sorted(Path(url, "features").glob("*.parquet")):
        table = pq.read_table(path)
        summaries.append(json.loads(table.schema.metadata[SHARD_META_KEY]))
        rows += table.to_pylist()
    return rows, summaries


@torch.inference_mode()
def hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max over positions of max |got - ref| / max |ref| at that position."""
    got, ref = got.double(), ref.double()
    return float(((got - ref).abs().amax(-1) / ref.abs().amax(-1)).max())


def test_sink_on_answers_as_off_and_writes_what_was_served(models, tmp_path):
    from eagle_core.capture import capture_features
    from eagle_core.chat import encode_prompt, served_loss_mask
    from pipelines.feature_files import decode_hidden, load_manifest

    target, tokenizer = models[2], models[3]
    off = start(models)
    try:
        assert off.traffic is None and off.engine.sink is None and not off.engine.capture
        with uvicorn_thread(replica_app(off)) as url:
            plain = ask(url)
            off_metrics = __import__("httpx").get(f"{url}/metrics").text
    finally:
        off.close()
    assert PREFILLS and all(capture is None for _, capture in PREFILLS)  # sink off: no capture
    assert "traffic" not in off_metrics
    assert not any(tmp_path.iterdir())  # (nothing anywhere to write to)

    out = str(tmp_path / "traffic")
    PREFILLS.clear()
    on = start(models, traffic_url=out, traffic_rows_per_shard=2)
    try:
        with uvicorn_thread(replica_app(on)) as url:
            served = ask(url)
            on.traffic.flush(60)
            text = __import__("httpx").get(f"{url}/metrics").text
    finally:
        on.close()
    assert PREFILLS and all(capture is True for _, capture in PREFILLS)

    # the same answers, sink on or off
    assert [answer_text(b) for b in served] == [answer_text(b) for b in plain]
    assert [b["usage"] for b in served] == [b["usage"] for b in plain]

    rows, summaries = read_rows(out)
    assert len(rows) == len(served) and len(summaries) == 3  # 2 + 2 rows, then the flush's 1
    prompts = [encode_prompt(tokenizer, p) for p in PROMPTS] + [encode_prompt(tokenizer, CHAT)]
    meta = {k: v for s in summaries for k, v in s["row_meta"].items()}
    categories = {}
    for s in summaries:
        for label, n in s["categories"].items():
            categories[label] = categories.get(label, 0) + n
    assert categories == {"default": 2, "code": 2, "story": 1}
    by_prompt = {}
    for row in rows:  # which request a row is: its prompt (all differ)
        match = [i for i, p in enumerate(prompts) if row["input_ids"][: len(p)] == p]
        assert len(match) == 1
        by_prompt[match[0]] = row
    assert sorted(by_prompt) == list(range(len(prompts)))
    expected_labels = ["default", "code", "story", "code", "default"]
    worst = 0.0
    for i, prompt in enumerate(prompts):
        row, body = by_prompt[i], served[i]
        ids, n_answer = row["input_ids"], body["usage"]["completion_tokens"]
        answer = ids[len(prompt):]
        assert len(answer) == n_answer and answer == hf_greedy(target, prompt, n_answer)  # as served: lossless
        messages = CHAT if i == len(PROMPTS) else None
        assert row["loss_mask"] == served_loss_mask(tokenizer, messages, prompt, n_answer)
        assert meta[row["id"]] == {"category": expected_labels[i]}
        width = target.config.hidden_size
        aux = decode_hidden(row["aux_hidden"], "float32", 3 * width)
        last = decode_hidden(row["last_hidden"], "float32", width)
        ref = capture_features(target, torch.tensor([ids]))
        assert aux.shape == (len(ids), 3 * width) and last.shape == (len(ids), width)
        # a final token that was a round's bonus went through no forward: zeros in the row; one cut from an accepted
        # path by max_tokens was verified, so it has its features
        n = len(ids) - 1 if not (aux[-1].any() or last[-1].any()) else len(ids)
        worst = max(worst, relative_error(aux[:n], ref.aux_hidden[0, :n]),
                    relative_error(last[:n], ref.last_hidden[0, :n]))
    assert worst < FP32_REL, f"served features differ from a fresh capture by {worst:.2e} relative"
    manifest = load_manifest(out)
    assert manifest.rows == len(rows) and manifest.corpus == "traffic"

    assert metric(text, "eagle3_serve_traffic_records_total", outcome="offered") == len(served)
    assert metric(text, "eagle3_serve_traffic_records_total", outcome="written") == len(served)
    assert metric(text, "eagle3_serve_traffic_shards_total") == 3
    assert metric(text, "eagle3_serve_traffic_dropped_total", reason="engine_error") == 0


def test_a_failing_store_loses_no_request_and_counts_drops(models, tmp_path):
    import httpx

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    service = start(models, traffic_url=str(blocker / "traffic"), traffic_rows_per_shard=1)
    try:
        with uvicorn_thread(replica_app(service)) as url:
            served = ask(url)  # every request answered 200 (ask asserts it)
            service.traffic.flush(60)
            text = httpx.get(f"{url}/metrics").text
    finally:
        service.close()
    assert all(answer_text(b) for b in served)
    assert metric(text, "eagle3_serve_traffic_records_total", outcome="offered") == len(served)
    assert metric(text, "eagle3_serve_traffic_dropped_total", reason="store_error") == len(served)
    assert metric(text, "eagle3_serve_traffic_records_total", outcome="written") == 0
    assert service.traffic.stats()["last_error"].startswith("store_error")


def test_bad_sink_settings_stop_the_replica_before_any_model_loads(models, monkeypatch):
    from pipelines.serve.config import ServeConfig

    for bad in (dict(traffic_sample_rate=1.5), dict(traffic_rows_per_shard=0), dict(traffic_max_bytes=0),
                dict(traffic_max_age_s=-1), dict(traffic_redact="no-colon"), dict(traffic_url="")):
        with pytest.raises(ValueError):
            ServeConfig(**bad)

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("pipelines.serve.service.load_models", no_load)
    with pytest.raises(ModuleNotFoundError):
        start(models, traffic_url="/nonexistent/traffic", traffic_redact="no_such_module_xyz:redact")


def test_static_caches_with_sink_features_are_refused():
    from eagle_core.static_rows import StaticConfig
    from pipelines.serve.engine import Engine, EngineConfig
    from pipelines.traffic import TrafficSink
    from pipelines.traffic_config import TrafficConfig

    sink = TrafficSink(TrafficConfig(url=None, features=True))  # off: nothing starts; the engine reads its config
    with pytest.raises(ValueError, match="static caches"):
        Engine(None, None, None, EngineConfig(static=StaticConfig()), sink=sink)
