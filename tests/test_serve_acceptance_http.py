"""Acceptance as a live signal over HTTP (issue 43, part 1): one replica's routes (`Routes` over a real `Service`,
as the deployment wires them) on uvicorn, the tiny damped target, the echo draft served from the MLflow registry
(`models:/<name>@champion`, whose version carries the evaluation tau tag that retraining's promotion sets).

Properties:
- Requests labelled by the header `x-eagle3-category` or the body field `category` (the body wins; streamed
  and plain alike) land in /metrics' per-label tau and accept-length histograms, one observation per finished
  request; labels beyond `acceptance_max_labels` are counted under "other"; no label means "default".
- A malformed label (header or body) gets a 400 that names it, and is not counted.
- With the registry's reference tau above what the echo draft reaches, each label's window raises the drift
  alert gauge once it holds `acceptance_window` requests; the drift hook is called once (cooldown); the replica's
  MLflow serving run, tagged with the served version, holds each label's window summary and drift event.
- The live Ray Serve deployment (shared with test_serve*.py) exports the per-label histograms too (Ray's metric
  export takes the labels) and refuses a malformed label.
"""

import json

import pytest
import torch

from decode_helpers import echo_draft, single_thread  # noqa: F401 (autouse: 1 torch thread in this process)
from serve_helpers import API_KEY, live_deployment, metric, replica_app, save_target, sse_events, uvicorn_thread

NAME = "acceptance-echo-draft"
MODEL = "tiny-acceptance"
REFERENCE_TAU = 9.0  # above any tau a depth-4 tree reaches (at most 5): every full window alerts
HOOK_EVENTS: list = []


def on_drift(event: dict) -> None:  # the drift hook, by its import path
    HOOK_EVENTS.append(event)


@pytest.fixture(scope="module")
def replica(tmp_path_factory, smollm2_tokenizer):
    from mlflow import MlflowClient

    from eagle_core.checkpoint import save_draft
    from eagle_core.target import load_target
    from pipelines import tracking
    from pipelines.retrain import register_draft_folder
    from pipelines.serve.config import ServeConfig
    from pipelines.serve.service import Service

    target_dir = save_target(tmp_path_factory.mktemp("acceptance-target"), smollm2_tokenizer)
    target, _ = load_target(str(target_dir), device="cpu", dtype=torch.float32)
    draft_dir = tmp_path_factory.mktemp("acceptance-draft")
    save_draft(echo_draft(target), draft_dir)
    tracking.configure()  # this test process's own store (tests/conftest.py)
    version = str(register_draft_folder(str(draft_dir), NAME, experiment="serve-acceptance-tests",
                                        run_name="echo-draft"))
    client = MlflowClient()
    client.set_model_version_tag(NAME, version, "tau", str(REFERENCE_TAU))  # as retraining's promotion records it
    HOOK_EVENTS.clear()
    service = Service(ServeConfig(target=str(target_dir), draft=f"models:/{NAME}@champion", draft_poll_s=0,
                                  model_name=MODEL, dtype="float32", device="cpu", top_k=4, depth=4,
                                  total_tokens=12, mode_policy="static", tree_max_batch=4, max_context=256,
                                  max_tokens_limit=64, torch_threads=1, acceptance_window=2,
                                  acceptance_max_labels=3, acceptance_experiment="serve-acceptance-live",
                                  drift_hook="test_serve_acceptance_http:on_drift"))
    try:
        with uvicorn_thread(replica_app(service)) as url:
            yield url, service, client, version
    finally:
        service.close()


def test_labels_histograms_drift_and_mlflow(replica):
    import httpx

    url, service, client, version = replica
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    header = "x-eagle3-category"
    with httpx.Client(base_url=url, timeout=120) as c:
        sent = [  # (label it counts under, request)
            ("code", dict(json=body, headers={header: "code"})),
            ("code", dict(json={**body, "prompt": "def f(x):"}, headers={header: "code"})),
            ("chat", dict(json={**body, "category": "chat"})),
            ("chat", dict(json={**body, "category": "chat", "stream": True}, headers={header: "code"})),
            ("default", dict(json=body)),
            ("other", dict(json={**body, "category": "beyond-the-cap"})),
        ]
        for _, kwargs in sent:
            r = c.post("/v1/completions", **kwargs)
            assert r.status_code == 200, r.text
            if kwargs["json"].get("stream"):
                assert sse_events(r.text)[-1] == "[DONE]"
        refused = [c.post("/v1/completions", json=body, headers={header: "bad label!"}),
                   c.post("/v1/completions", json={**body, "category": "a/b"}),
                   c.post("/v1/completions", json={**body, "category": "x" * 65}),
                   c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "category": 5})]
        text = c.get("/metrics").text
    for r in refused:
        assert r.status_code == 400, r.text
    errors = [r.json()["error"] for r in refused]
    assert header in errors[0]["message"] and errors[0]["code"] == "invalid_category"
    assert errors[1]["param"] == "category" and "1-64 characters" in errors[1]["message"]
    assert errors[3]["param"] == "category"  # not a string

    counts = {label: sum(1 for lab, _ in sent if lab == label) for label, _ in sent}
    for label, n in counts.items():  # one tau observation per finished request, under its label only
        assert metric(text, "eagle3_serve_request_tau_count", category=label) == n, label
        assert metric(text, "eagle3_serve_category_accept_length_count", category=label) >= n  # >= 1 round each
    assert "beyond-the-cap" not in text and 'category="a/b"' not in text
    assert metric(text, "eagle3_serve_acceptance_reference_tau") == REFERENCE_TAU
    for label in ("code", "chat"):  # windows of 2 requests filled: alert raised once
        assert metric(text, "eagle3_serve_drift_alert", category=label) == 1
        assert metric(text, "eagle3_serve_drift_alerts_total", category=label) == 1
        assert 1 <= metric(text, "eagle3_serve_acceptance_window_tau", category=label) < REFERENCE_TAU - 0.3
    assert metric(text, "eagle3_serve_drift_alert", category="default") == 0  # one request: window not full

    assert service.reporter.flush(60)
    assert [e["category"] for e in HOOK_EVENTS] == ["code"]  # the chat alert came within the cooldown
    assert HOOK_EVENTS[0]["model"] == NAME and HOOK_EVENTS[0]["version"] == version
    runs = client.search_runs([client.get_experiment_by_name("serve-acceptance-live").experiment_id])
    assert len(runs) == 1 and runs[0].data.tags["eagle3.model_version"] == version
    run = runs[0]
    assert run.data.tags["eagle3.registered_model"] == NAME
    for label in ("code", "chat"):
        assert json.loads(run.data.tags[f"drift_alert.{label}"])["kind"] == "alert"
        assert run.data.metrics[f"drift_alert/{label}"] == 1.0
        assert run.data.metrics[f"requests/{label}"] == 2 and run.data.metrics[f"tau/{label}"] >= 1
    assert metric(text, "eagle3_serve_acceptance_reports_dropped_total") == 0


@pytest.fixture(scope="module")
def live(ray_cluster, tmp_path_factory, smollm2_tokenizer):
    return live_deployment(tmp_path_factory, smollm2_tokenizer)  # started once per session, shared


def test_live_deployment_exports_per_label_histograms(live):
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0}
    with live.client() as c:
        before = c.get("/metrics").text
        for label in ("alpha", "beta"):
            r = c.post("/v1/completions", json=body, headers={"x-eagle3-category": label})
            assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json=body, headers={"x-eagle3-category": "no spaces"})
        assert r.status_code == 400 and "x-eagle3-category" in r.json()["error"]["message"]
        after = c.get("/metrics").text
    for label in ("alpha", "beta"):
        name = "eagle3_serve_request_tau_count"
        assert metric(after, name, category=label) == metric(before, name, category=label) + 1
    assert API_KEY  # the live deployment's token: the client sends it
