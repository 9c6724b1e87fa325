"""Benchmark: the live-traffic loop end to end (issue 43's must-show), with real components on this machine.

    python -m bench.traffic_loop            (full: ~16 min on a quiet 2-core CPU, most of it the 60 training steps)
    python -m bench.traffic_loop --quick    (tiny counts: ~3 min on a quiet 2-core CPU, mostly fixed costs: Ray
                                             Train's start, the extraction actor's, the evaluations' auto-tune)

Stages, each timed (SmolLM2-135M-Instruct from the local cache, its shipped draft; a fresh local Ray cluster; an
MLflow SQLite store under --work; every server on 127.0.0.1):

1. *Champion*: the shipped draft's evaluation tau on the base set (`--eval-prompts`, MT-bench turn 1: chat, the
   draft's training distribution) is measured as retraining measures it (`pipelines.retrain.evaluate.evaluate_on_worker`,
   the recipe's tree), and the draft is registered as `champion` with that tau tagged
   (`pipelines.registry.register_draft_folder`): the reference of the serving replicas' drift rule.
2. *Traffic*: the Serve app (`pipelines.serve.app.build_app`) serves `models:/<name>@champion` with the
   traffic sink on (features captured while decoding) and the drift rule on (`--window` requests, `--drift-margin`),
   the recipe's tree every round (mode policy "static": the drift window pools tree rounds, compared with a tau
   measured on the same tree), in the dtype and answer length the reference was measured in (`--dtype` auto, as
   deployments and evaluations default: greedy tau moves with the dtype by more than the margin on this pair, so a
   reference measured otherwise alerts, or stays silent, for the dtype alone). Prompts of a distribution the draft
   never trained on (`--traffic-prompts`, by default bench/prompts/non-english.jsonl: 300 templated questions in
   French, Spanish, Italian, Portuguese and German, interleaved) are sent one at a time through
   /v1/chat/completions, greedy, label "unseen"; after each, /metrics is read: the request at which the drift
   alert first stands is recorded, and the alert's MLflow event (the serving run's tag) is read back.
3. *Sink*: once the sink has written every record it was offered, the app is deleted; its shards are counted.
4. *Sink off*: the same app with no traffic_url answers a request; no shard or manifest appears anywhere under
   --work and /metrics has no traffic series.
5. *Retraining*: `pipelines.retrain.run_retrain` with `traffic` = the sink's URL, as `jobs/retrain.py --traffic URL`
   runs it (the recipe applied by `jobs.retrain.apply_recipe`; the recipe's tree as the evaluation tree), bounded by
   `--train-steps` and a small base corpus (`--base-rows` ShareGPT rows, prefill only): warm start from the
   champion, the traffic's held-out slice decoded by candidate and champion beside the base set, promotion by the
   two-tau rule. Training reads the sink's shards as they are: the retrain's only extraction is the base corpus's,
   and the rows training reads from the sink are counted (`pipelines.train.driver.files_rows`).

The result (every number above, the settings, command, machine, date) is written as JSON and Markdown under
`--out` (bench/results/traffic-loop/), named by the run's date; `--quick` results get a `-quick` suffix. The
run's state (MLflow store, shards, drafts, logs of the noisy stages) stays under --work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from bench.common import RESULTS, ROOT, SHIPPED_DRAFT, command, machine, shown_path, write_json, write_markdown
from pipelines.console import quiet_terminal, say

NAME = "traffic-loop-draft"  # the registered model
MODEL = "smollm2-eagle3"  # the id clients send
LABEL = "unseen"  # the category label of the traffic
# The shipped draft (English chat) accepts on these about 0.55 less than on MT-bench (bf16, 32 tokens, tree 8/2/16:
# 1.27-1.33 on two slices of 40 vs 1.86); on HumanEval it accepts as much as on MT-bench (1.91 vs 1.86), so code is
# no drift for it (bench/prompts/make_non_english.py says how the prompts were made).
UNSEEN_PROMPTS = ROOT / "bench" / "prompts" / "non-english.jsonl"
PRESETS = {  # (quick, full): counts only; every rule and threshold is the same in both
    "requests": (12, 160), "window": (4, 8), "eval_count": (2, 5),
    "eval_max_new_tokens": (16, 32), "base_rows": (8, 24), "train_steps": (3, 60),
    "traffic_eval_fraction": (0.4, 0.3),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny counts: a check, not a measurement")
    p.add_argument("--out", default=str(RESULTS / "traffic-loop"), help="folder of the result files")
    p.add_argument("--work", default=None, help="the run's state: MLflow store, shards, drafts, logs "
                   "(default work/traffic-loop/<date>; must not exist)")
    p.add_argument("--requests", type=int, help="requests served with the sink on")
    p.add_argument("--traffic-prompts", default=str(UNSEEN_PROMPTS),
                   help="the served traffic: a JSONL file of prompts, or `humaneval` / `mtbench`")
    p.add_argument("--window", type=int, help="the drift rule's window (requests per label)")
    p.add_argument("--drift-margin", type=float, default=0.1,
                   help="alert when the window's tau < the champion's evaluation tau - this")
    p.add_argument("--max-tokens", type=int, help="tokens per served answer (default: --eval-max-new-tokens, the "
                   "reference's answer length)")
    p.add_argument("--dtype", default="auto", help="the replicas' dtype (default auto, as deployed: the dtype "
                   "the champion's evaluation measured its reference tau in; float32: features bit-comparable to an "
                   "fp32 extraction's)")
    p.add_argument("--eval-prompts", default="mtbench", help="the base evaluation set (pipelines/prompt_sets.py)")
    p.add_argument("--eval-count", type=int, help="prompts per evaluation (base set, and held-out traffic)")
    p.add_argument("--eval-max-new-tokens", type=int, help="tokens per evaluation prompt")
    p.add_argument("--base-rows", type=int, help="ShareGPT rows of the retraining's base corpus (prefill only)")
    p.add_argument("--train-steps", type=int, help="optimiser steps of the retraining (max_steps)")
    p.add_argument("--traffic-ratio", type=float, default=0.5, help="fraction of training rows drawn from traffic")
    p.add_argument("--traffic-eval-fraction", type=float, help="traffic held out (by id hash) for the evaluation")
    p.add_argument("--margin", type=float, default=0.05, help="tau gain on held-out traffic needed to promote")
    p.add_argument("--base-margin", type=float, default=0.1, help="the most the base tau may fall for a promotion")
    p.add_argument("--port", type=int, default=0, help="Serve's HTTP port on 127.0.0.1 (0: a free one)")
    p.add_argument("--note", default="", help="a line recorded with the result")
    args = p.parse_args(argv)
    for key, (quick, full) in PRESETS.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.max_tokens is None:
        args.max_tokens = args.eval_max_new_tokens
    return args


# ---- small pieces -----------------------------------------------------------------------------------------------

def quiet(log: Path):
    """This process's output (Ray's and MLflow's too) to `log` while a noisy stage runs (`quiet_terminal`)."""
    return quiet_terminal(str(log), tags=())


def metrics(url: str) -> dict:
    """/metrics as {(name, ((label, value), ...)): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(values: dict, name: str, **labels) -> float | None:
    return values.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))))


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def unseen_prompts(args, n: int) -> list[dict]:
    """The first n prompts of `--traffic-prompts` (`pipelines.prompt_sets.prompt_set`), as chat requests."""
    from pipelines.prompt_sets import prompt_set

    items = prompt_set(args.traffic_prompts, None, n, 0)[0]
    if len(items) < n:
        raise SystemExit(f"--traffic-prompts {args.traffic_prompts} has {len(items)} prompts; this run needs {n}")
    return items


def retrain_config(args, work: Path, traffic: str | None, recipe):
    """The RetrainConfig `jobs/retrain.py` would build from these flags (its parser, then the recipe's values by
    `jobs.retrain.apply_recipe`), with the recipe's tree as the evaluation tree (no CLI flag sets it). Returns
    (config, the equivalent command line)."""
    from jobs.retrain import apply_recipe, build_parser
    from pipelines.retrain import RetrainConfig

    argv = ["--corpus", "sharegpt", "--scales", str(args.base_rows), "--corpus-rows", str(args.base_rows),
            "--work", str(work / "retrain"), "--registered-model", NAME, "--eval-prompts", args.eval_prompts,
            "--eval-count", str(args.eval_count), "--eval-max-new-tokens", str(args.eval_max_new_tokens),
            "--eval-cpus", "2", "--eval-gpus", "0", "--margin", str(args.margin),
            "--mlflow-experiment", "traffic-loop-retrain",
            "--extract", json.dumps({"regenerate": False, "rows_per_shard": 8, "cpus_per_worker": 2,
                                     "mlflow_experiment": None}),
            "--train", json.dumps({"max_steps": args.train_steps, "epochs": 100, "cpus_per_worker": 2,
                                   "checkpoint_every": 1000, "log_every": 5,
                                   "mlflow_experiment": "traffic-loop-train"})]
    if traffic:
        argv += ["--traffic", traffic, "--traffic-ratio", str(args.traffic_ratio), "--traffic-eval-fraction",
                 str(args.traffic_eval_fraction), "--base-margin", str(args.base_margin)]
    parsed = vars(build_parser().parse_args(argv))
    for key in ("address", "results", "rollback"):
        parsed.pop(key)
    parsed = apply_recipe(parsed, recipe)
    return RetrainConfig(**parsed, eval_tree=recipe.tree_config()), "python jobs/retrain.py " + " ".join(
        a if a.startswith("--") or " " not in a and '"' not in a else f"'{a}'" for a in argv)


def serve_args(args, tree, traffic_url: str | None) -> dict:
    """The Serve app's args: `--dtype`, the recipe's tree every round, the drift rule on, the sink on exactly when
    `traffic_url` is set (committing small shards soon)."""
    out = dict(target="smollm2-135m", draft=f"models:/{NAME}@champion", draft_poll_s=0, model_name=MODEL,
               dtype=args.dtype, top_k=tree.top_k, depth=tree.depth, total_tokens=tree.total_tokens,
               mode_policy="static", max_context=1024, max_tokens_limit=max(args.max_tokens, 16), torch_threads=2,
               num_cpus=1, num_gpus=0, acceptance_window=args.window, drift_margin=args.drift_margin,
               acceptance_experiment="traffic-loop-serving")
    if traffic_url:
        out.update(traffic_url=traffic_url, traffic_rows_per_shard=8, traffic_flush_after_s=2.0)
    return out


def ask(url: str, messages: list[dict], max_tokens: int) -> dict:
    import httpx

    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "category": LABEL})
    r.raise_for_status()
    body = r.json()
    spec = body.get("speculative") or {}
    return {"tau": spec.get("tau"), "draft_rounds": spec.get("draft_rounds"), "rounds_by_mode": spec.get("rounds_by_mode"),
            "completion_tokens": body["usage"]["completion_tokens"], "seconds": round(time.perf_counter() - start, 2)}


def drift_event_from_mlflow(timeout_s: float = 60.0) -> dict | None:
    """The first drift alert the replica logged to its MLflow serving run (metric drift_alert/<label> = 1, beside
    drift_window_tau/<label>; a later clear logs 0 and rewrites the run's drift_alert.<label> tag), or None."""
    from mlflow import MlflowClient

    client = MlflowClient()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        experiment = client.get_experiment_by_name("traffic-loop-serving")
        for run in client.search_runs([experiment.experiment_id]) if experiment is not None else []:
            alerts = sorted(client.get_metric_history(run.info.run_id, f"drift_alert/{LABEL}"),
                            key=lambda m: m.timestamp)
            taus = sorted(client.get_metric_history(run.info.run_id, f"drift_window_tau/{LABEL}"),
                          key=lambda m: m.timestamp)
            for i, m in enumerate(alerts):
                if m.value == 1.0:
                    return {"run_id": run.info.run_id, "kind": "alert", "events": len(alerts),
                            "window_tau": taus[i].value if i < len(taus) else None,
                            "model_version": run.data.tags.get("eagle3.model_version"),
                            "last_event_tag": json.loads(run.data.tags.get(f"drift_alert.{LABEL}", "null"))}
        time.sleep(1)
    return None


# ---- the stages -------------------------------------------------------------------------------------------------

def stage_champion(args, base_config, log: Path) -> dict:
    from pipelines.registry import CHAMPION, register_draft_folder
    from pipelines.retrain.evaluate import evaluate_on_worker

    with quiet(log):
        evaluation = evaluate_on_worker(base_config, {"champion": str(SHIPPED_DRAFT)})["champion"]
        version = register_draft_folder(str(SHIPPED_DRAFT), NAME, CHAMPION, experiment="traffic-loop",
                                        run_name="shipped-draft", expected_champion=None, tau=evaluation["tau"],
                                        tau_dtype=evaluation["dtype"])
    return {"version": int(version), "tau": evaluation["tau"], "prompts": evaluation["prompts"],
            "dtype": evaluation["dtype"]}


def stage_traffic(args, tree, traffic_url: str, port: int, log: Path) -> dict:
    """Serve the unseen traffic with the sink and the drift rule on; returns per-request records, the alert, the sink's
    counts and the MLflow event."""
    from ray import serve

    from pipelines.serve.app import build_app, run_local

    with quiet(log):
        url = run_local(build_app(serve_args(args, tree, traffic_url)), "traffic-loop-on", port)
    requests, alert_at = [], None
    for i, item in enumerate(unseen_prompts(args, args.requests), 1):
        record = {"id": item["id"], **ask(url, item["messages"], args.max_tokens)}
        values = metrics(url)
        record["window_tau"] = sample(values, "eagle3_serve_acceptance_window_tau", category=LABEL)
        record["alert"] = sample(values, "eagle3_serve_drift_alert", category=LABEL) == 1.0
        if record["alert"] and alert_at is None:
            alert_at = i
        requests.append(record)
        say(f"  request {i:>3} {item['id']:<14} tau {record['tau']:.2f}  window tau "
            f"{'-' if record['window_tau'] is None else round(record['window_tau'], 3)}"
            f"{'  ALERT' if record['alert'] else ''}")
    deadline = time.monotonic() + 120  # the sink commits on its own thread: wait until all it was offered is written
    while True:
        values = metrics(url)
        offered = sample(values, "eagle3_serve_traffic_records_total", outcome="offered") or 0
        written = sample(values, "eagle3_serve_traffic_records_total", outcome="written") or 0
        if written >= offered or time.monotonic() > deadline:
            break
        time.sleep(1)
    reference = sample(values, "eagle3_serve_acceptance_reference_tau")
    alerts = sample(values, "eagle3_serve_drift_alerts_total", category=LABEL)
    dropped = {labels[0][1]: v for (name, labels), v in values.items()
               if name == "eagle3_serve_traffic_records_total" and labels and labels[0][1] not in ("offered", "written")}
    event = drift_event_from_mlflow()
    with quiet(log):
        serve.delete("traffic-loop-on")
    return {"url": url, "requests": requests, "alert_at_request": alert_at, "alerts_total": alerts,
            "reference_tau_in_metrics": reference, "offered": offered, "written": written, "not_written": dropped,
            "mlflow_event": event}


def stage_sink_off(args, tree, work: Path, port: int, log: Path) -> dict:
    from ray import serve

    from pipelines.serve.app import build_app, run_local

    before = files_under(work)
    with quiet(log):
        url = run_local(build_app(serve_args(args, tree, None)), "traffic-loop-off", port)
    item = unseen_prompts(args, args.requests + 1)[-1]  # a prompt the sink-on deployment was not sent
    answer = ask(url, item["messages"], args.max_tokens)
    values = metrics(url)
    time.sleep(3)  # longer than the sink-on deployment's flush interval: a sink, if any, would have committed
    with quiet(log):
        serve.delete("traffic-loop-off")
    new = sorted(f for f in files_under(work) - before if f.endswith((".parquet", "manifest.json")))
    return {"answered": answer["completion_tokens"] > 0, "completion_tokens": answer["completion_tokens"],
            "traffic_series": sorted({name for name, _ in values if "traffic" in name}), "new_shard_files": new}


def sink_counts(url: str) -> dict:
    from pipelines.feature_files import load_manifest

    manifest = load_manifest(url)
    folder = Path(url)
    return {"rows": manifest.rows, "shards": len(manifest.shards), "tokens": manifest.tokens,
            "corpus": manifest.corpus, "dtype": manifest.dtype, "aux_layer_ids": list(manifest.aux_layer_ids),
            "bytes": sum(p.stat().st_size for p in (folder / "features").glob("*.parquet")),
            "top_level": sorted(p.name for p in folder.iterdir())}


def training_reads(config, rows: int) -> dict:
    """What the retraining's training run reads of each source: its own planning (`files_rows`) of the job's
    features (the base extraction and the sink's URL as it is)."""
    from pipelines.feature_files import load_manifest
    from pipelines.retrain import features_url
    from pipelines.retrain.traffic import training_features
    from pipelines.train import TrainJobConfig
    from pipelines.train.driver import files_rows

    base = features_url(config, rows)
    job = TrainJobConfig(**{**config.train, "features": training_features(config, base), "target": config.target})
    _, train_rows, eval_rows, weights = files_rows(job)
    return {"base_features": shown_path(base), "base_extracted_rows": load_manifest(base).rows,
            "weights": weights, "traffic_train_rows": sum(r["source"] == 1 for r in train_rows),
            "traffic_eval_split_rows": sum(r["source"] == 1 for r in eval_rows),
            "base_train_rows": sum(r["source"] == 0 for r in train_rows)}


def stage_retrain(config, log: Path) -> dict:
    from pipelines.registry import CHAMPION, alias_version
    from pipelines.retrain import run_retrain
    from pipelines.retrain.traffic import beats_on_traffic, check_traffic

    slice_ = check_traffic(config)
    with quiet(log):
        result = run_retrain(config)["scales"][0]
    summary = json.loads(Path(result["draft"]).parent.joinpath("summary.json").read_text())
    new = {"tau": result["tau"], "traffic_tau": result["traffic_tau"]}
    champion = {"tau": result["champion_tau"], "traffic_tau": result["champion_traffic_tau"]}
    return {"slice": slice_, "version": result["version"], "promoted": result["promoted"],
            "rule_says": beats_on_traffic(new, champion, config.margin, config.base_margin),
            "champion_alias_version": int(alias_version(NAME, CHAMPION).version),
            "candidate": new, "champion": champion, "traffic_prompts": result["traffic_prompts"],
            "candidate_speedup": result["speedup"], "champion_speedup": result["champion_speedup"],
            "train": {"steps": summary["step"], "total_steps": summary.get("total_steps"),
                      "train_rows": summary.get("train_rows"), "seconds": round(summary.get("seconds", 0), 1),
                      "metrics": {k: round(v, 4) for k, v in summary.get("metrics", {}).items()
                                  if k.startswith(("loss", "acc", "eval"))}},
            "reused_shards": result["reused_shards"], "shards": result["shards"]}


# ---- result ----------------------------------------------------------------------------------------------------

def checks(result: dict) -> dict:
    """The properties that must hold whatever the taus are (the exit status is 1 when one does not)."""
    traffic, off, retrain, reads = result["traffic"], result["sink_off"], result["retrain"], result["training_reads"]
    return {
        # every request is unseen-distribution traffic, so any window that raises it is one of that traffic alone;
        # whether it stood at the first full window (request == window) is recorded beside, not required
        "alert_raised": traffic["alert_at_request"] is not None and traffic["alerts_total"] >= 1,
        "alert_in_mlflow": bool(traffic["mlflow_event"]) and traffic["mlflow_event"].get("kind") == "alert",
        "every_request_written": traffic["written"] == traffic["offered"] == len(traffic["requests"])
        == result["sink"]["rows"],
        "sink_trains_without_extraction": reads["traffic_train_rows"] > 0
        and reads["base_extracted_rows"] == result["settings"]["base_rows"]
        and not {"regenerated", "quarantine"} & set(result["sink"]["top_level"]),
        "sink_off_writes_nothing": off["answered"] and not off["new_shard_files"] and not off["traffic_series"],
        "promotion_follows_the_rule": retrain["promoted"] == retrain["rule_says"]
        and (retrain["champion_alias_version"] == retrain["version"]) == retrain["promoted"],
    }


def write_result(args, argv, result: dict) -> Path:
    stamp = time.strftime("%Y-%m-%d-%H%M", time.gmtime())
    path = Path(args.out) / f"{stamp}{'-quick' if args.quick else ''}.json"
    write_json(path, result, indent=1)
    r, t, ret, s = result, result["traffic"], result["retrain"], result["settings"]
    taus = [q["tau"] for q in t["requests"]]

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    lines = [f"# The live-traffic loop end to end ({r['date']}{', quick' if args.quick else ''})", "",
             f"`{r['command']}` on {r['machine']}; wall time {r['wall_s']} s. SmolLM2-135M-Instruct (local cache) and "
             "its shipped draft, a local Ray cluster and Ray Serve on 127.0.0.1, an MLflow SQLite store. "
             f"Tree {s['tree']} in every served round and every evaluation; serving {r['sink']['dtype']} (`--dtype "
             f"{s['dtype']}`), the champion's reference tau measured in {r['champion'].get('dtype', '-')}; "
             "retraining's evaluations in `load_target`'s default dtype.", "",
             "| what | value |", "|---|---|",
             f"| champion (shipped draft) evaluation tau, {s['eval_prompts']} x {s['eval_count']} | "
             f"{f(r['champion']['tau'])} (tagged on version {r['champion']['version']}) |",
             f"| {shown_path(s['traffic_prompts'])} requests served ({r['sink']['dtype']}, greedy, {s['max_tokens']} tokens) | {len(taus)}, "
             f"mean per-request tau {f(sum(taus) / len(taus))} |",
             f"| drift rule | window {s['window']} requests, alert below {f(r['champion']['tau'])} - "
             f"{s['drift_margin']} |",
             f"| drift alert first stands after request (the window is first full at request {s['window']}) | "
             f"{t['alert_at_request']} (window tau "
             f"{f(t['requests'][t['alert_at_request'] - 1]['window_tau']) if t['alert_at_request'] else '-'}) |",
             f"| drift alert in MLflow (serving run tag) | {'yes' if t['mlflow_event'] else 'no'}"
             f"{', window tau ' + f(t['mlflow_event']['window_tau']) if t['mlflow_event'] else ''} |",
             f"| sink: records offered / written / rows in manifest | {t['offered']:.0f} / {t['written']:.0f} / "
             f"{r['sink']['rows']} in {r['sink']['shards']} shards ({r['sink']['bytes'] / 2**20:.1f} MiB, "
             f"{r['sink']['dtype']}, aux layers {r['sink']['aux_layer_ids']}) |",
             f"| training reads from the sink, no extraction | {r['training_reads']['traffic_train_rows']} traffic rows "
             f"(+ {r['training_reads']['base_train_rows']} base rows extracted from ShareGPT) |",
             f"| held-out traffic | {ret['slice']['held_out']} of {ret['slice']['rows']} conversations, "
             f"{ret['traffic_prompts']} decoded |",
             f"| retraining | {ret['train']['steps']} steps, warm start from the champion, traffic ratio "
             f"{s['traffic_ratio']}, {ret['train']['seconds']} s of training |",
             f"| tau on held-out traffic: champion -> candidate | {f(ret['champion']['traffic_tau'])} -> "
             f"{f(ret['candidate']['traffic_tau'])} (needs > +{s['margin']}) |",
             f"| tau on the base set: champion -> candidate | {f(ret['champion']['tau'])} -> "
             f"{f(ret['candidate']['tau'])} (may fall by <= {s['base_margin']}) |",
             f"| promoted | {'yes' if ret['promoted'] else 'no'} (version {ret['version']}; champion now version "
             f"{ret['champion_alias_version']}) |",
             f"| sink off: request answered, shard files written, traffic series | "
             f"{'yes' if r['sink_off']['answered'] else 'no'}, {len(r['sink_off']['new_shard_files'])}, "
             f"{len(r['sink_off']['traffic_series'])} |", "",
             "Stage wall times (s): " + ", ".join(f"{k} {v}" for k, v in r["stage_s"].items()) + "; the machine's "
             "1-minute load average at each stage's start and end: " + ", ".join(
                 f"{k} {v[0]}-{v[1]}" for k, v in r.get("load_1min", {}).items()) + " (2 cores: above 2, other jobs "
             "shared it).", "",
             "Checks (hold whatever the numbers): " + ", ".join(f"{k} {'yes' if v else 'NO'}"
                                                                for k, v in r["checks"].items()) + ".", ""]
    if r.get("note"):
        lines += [r["note"], ""]
    write_markdown(path, "\n".join(lines))
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    work = Path(args.work or ROOT / "work" / "traffic-loop" / stamp).resolve()
    work.mkdir(parents=True, exist_ok=False)
    log = work / "stages.log"
    # everything this run records lives under `work`: its own MLflow store, read by every Ray worker and replica
    os.environ["EAGLE3_WORK"] = str(work)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0",
                      MLFLOW_DISABLE_TELEMETRY="true", TOKENIZERS_PARALLELISM="false")
    os.environ.pop("RAY_ADDRESS", None)  # a fresh local cluster
    import ray

    from eagle_core.recipe import load_recipe
    from eagle_core.target import load_target

    say(f"[traffic-loop] work folder {shown_path(work)}")
    try:  # the target from the local cache only: nothing here reaches the network
        with quiet(log):
            load_target("smollm2-135m", device="cpu")
    except Exception as err:  # noqa: BLE001 - say why and stop
        say(f"[traffic-loop] SmolLM2 is not in the local cache ({err}); stopping")
        return 2
    recipe = load_recipe("smollm2-135m-instruct")
    traffic_url = str(work / "traffic")
    base_config, _ = retrain_config(args, work, None, recipe)
    config, retrain_command = retrain_config(args, work, traffic_url, recipe)
    tree = config.eval_tree
    port = args.port
    if not port:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    stage_s = {}

    load = {}  # the machine may be shared: its 1-minute load average at each stage's start and end

    def timed(name, fn, *a):
        t0, before = time.perf_counter(), os.getloadavg()[0]
        out = fn(*a)
        stage_s[name] = round(time.perf_counter() - t0, 1)
        load[name] = [round(before, 1), round(os.getloadavg()[0], 1)]
        return out

    with quiet(log):
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        say(f"[traffic-loop] 1/5 champion: evaluating the shipped draft on {args.eval_prompts} x {args.eval_count}")
        champion = timed("champion", stage_champion, args, base_config, log)
        say(f"  tau {champion['tau']:.3f}, registered as {NAME} version {champion['version']} @champion")
        say(f"[traffic-loop] 2/5 serving {args.requests} requests of {shown_path(args.traffic_prompts)}, sink on, drift window {args.window}, "
            f"margin {args.drift_margin}")
        traffic = timed("serve_sink_on", stage_traffic, args, tree, traffic_url, port, log)
        sink = sink_counts(traffic_url)
        say(f"  alert at request {traffic['alert_at_request']}; MLflow event "
            f"{'found' if traffic['mlflow_event'] else 'NOT found'}; sink {sink['rows']} rows in {sink['shards']} shards")
        say("[traffic-loop] 3/5 serving with the sink off")
        off = timed("serve_sink_off", stage_sink_off, args, tree, work, port, log)
        say(f"  answered {off['completion_tokens']} tokens; new shard files {off['new_shard_files'] or 'none'}")
        say(f"[traffic-loop] 4/5 retraining from traffic ({args.base_rows} base rows, {args.train_steps} steps): "
            f"{retrain_command}")
        retrain = timed("retrain", stage_retrain, config, log)
        reads = training_reads(config, args.base_rows)
        say(f"  tau on held-out traffic {retrain['champion']['traffic_tau']:.3f} -> "
            f"{retrain['candidate']['traffic_tau']:.3f}, on {args.eval_prompts} {retrain['champion']['tau']:.3f} -> "
            f"{retrain['candidate']['tau']:.3f}; {'promoted' if retrain['promoted'] else 'not promoted'}")
    finally:
        with quiet(log):
            with contextlib.suppress(Exception):
                from ray import serve

                serve.shutdown()
            ray.shutdown()
    result = {
        "what": "issue 43's loop end to end: drift alert on unseen traffic, the sink's shards trained on without "
                "extraction, a retraining from them judged on held-out traffic, a deployment with the sink off",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
        "command": command("traffic_loop", argv), "retrain_command": retrain_command,
        "wall_s": round(time.perf_counter() - started, 1), "stage_s": stage_s, "load_1min": load, "work": shown_path(work),
        "settings": {**{k: v for k, v in vars(args).items() if k not in ("out", "work", "note", "port")},
                     "tree": f"{tree.top_k}/{tree.depth}/{tree.total_tokens}",
                     "train": config.train, "extract": config.extract, "warm_start_lr": config.warm_start_lr,
                     "label": LABEL},
        "champion": champion, "traffic": traffic, "sink": sink, "sink_off": off, "retrain": retrain,
        "training_reads": reads, "note": args.note,
    }
    result["checks"] = checks(result)
    say("[traffic-loop] 5/5 result")
    write_result(args, argv, result)
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
