"""Evaluating drafts for retraining: each by real decoding of held-out prompts on the target (`evaluate_draft`: tau
and the speed-ups a user gets), several on one target load in a Ray task (`evaluate_on_worker`, on a GPU node where
the cluster has GPUs), which reports progress to the promotion lease when it runs under it. `pipelines.retrain.job`
compares what they return; with traffic, the held-out traffic's tau comes with it (`pipelines.retrain.traffic`).

With the serving-engine gate on (`RetrainConfig.serving_gate`, `pipelines.serving_gate`), each draft is also decoded
on the same prompts in vLLM, as vLLM's EAGLE-3 speculator at depth k, and by our decoder as a chain of that depth
(the draft as trained: the training checkpoint's folder where one is named in `references`); the result's
`serving_gate` holds both and the verdict, which promotion obeys.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING

from pipelines.console import progress
from pipelines.registry import PromotionConflict, PromotionLease
from pipelines.retrain.traffic import TRAFFIC_SET, traffic_prompts, traffic_tau
from pipelines.storage import resolve_source

if TYPE_CHECKING:
    from pipelines.retrain.job import RetrainConfig


def check_eval_prompts(source: str) -> None:
    """A named prompt set, or a JSONL file that exists: checked on the driver before any work."""
    from pipelines.prompt_sets import PROMPT_SETS

    if source in PROMPT_SETS:
        return
    import fsspec

    if not source.endswith(".jsonl"):
        raise ValueError(f"eval_prompts {source!r}: expected one of {PROMPT_SETS} or a .jsonl file")
    fs, path = fsspec.core.url_to_fs(source)
    if not fs.exists(path):
        raise FileNotFoundError(f"eval_prompts: no file at {source}")


def evaluate_draft(target, tokenizer, draft, prompts: list[dict], config: RetrainConfig, on_progress=None) -> dict:
    """tau, and the speed-ups a user gets on this machine.

    tau (the draft's quality, which promotion compares) comes from greedy decoding of all prompts with
    `config.eval_tree`; the same run gives the tau of every smaller tree, so `eagle_core.autotune` picks the
    tree that pays best here from measured target and draft costs. Then each prompt is decoded (batch 1,
    interleaved, the three in rotating order) with that tree every round, with the auto policy (trees only
    where they pay: what a user gets; it starts from the auto-tune's measurements) and plainly (the baseline
    of both speed-ups). prompts: `pipelines.prompt_sets` items, or {"set", "ids"} with the prompt's token ids (the
    held-out traffic); tau is also reported per set of them (from the tuned tree's rounds)."""
    from eagle_core.autotune import DEFAULT_SIZES, autotune, rotation
    from eagle_core.chat import prompt_ids
    from eagle_core.decoding import available_modes
    from eagle_core.generate import generate
    from eagle_core.policy import ModeChooser

    ids = [item["ids"] if "ids" in item else prompt_ids(tokenizer, item["messages"]) for item in prompts]
    full = config.eval_tree
    sizes = [s for s in DEFAULT_SIZES if s < full.total_tokens] + [full.total_tokens]
    context = sum(map(len, ids)) // len(ids) + config.eval_max_new_tokens // 2
    tuned = autotune(target, draft, ids, top_k=full.top_k, depth=full.depth, sizes=sizes, context_tokens=context,
                     max_new_tokens=config.eval_max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    modes = ("tree", "auto", "plain")
    tokens, seconds, auto_rounds = dict.fromkeys(modes, 0), dict.fromkeys(modes, 0.0), Counter()
    accepted, rounds = Counter(), Counter()  # per prompt set, the tuned tree's rounds
    chooser = ModeChooser(available_modes(tuned.tree))  # one policy for all prompts, as in a server
    tuned.prime(chooser)  # starting from the auto-tune's measurements, not from two rounds of each mode
    bar = progress(total=len(ids), desc="[retrain] evaluating", unit="prompt")
    for n, prompt in enumerate(ids):
        for mode in rotation(modes, n):  # each mode leads in turn: no order favours one
            start = time.perf_counter()
            out = generate(target, [prompt], draft=None if mode == "plain" else draft, tree=tuned.tree, mode=mode,
                           chooser=chooser, max_new_tokens=config.eval_max_new_tokens,
                           eos_token_id=tokenizer.eos_token_id)
            seconds[mode] += time.perf_counter() - start
            tokens[mode] += out.stats[0].new_tokens
            if mode == "auto":
                auto_rounds.update(out.stats[0].modes)
            if mode == "tree":
                accepted[prompts[n]["set"]] += sum(out.stats[0].accept_lengths)
                rounds[prompts[n]["set"]] += len(out.stats[0].accept_lengths)
        bar.update(1)
        if on_progress is not None:
            on_progress()
    bar.close()
    tps = {mode: tokens[mode] / max(seconds[mode], 1e-9) for mode in tokens}
    return {"tau": tuned.tau[f"{full.depth}/{full.size}"],  # the calibration tree itself
            "tuned_tree": asdict(tuned.tree), "tokens_per_s": tps["auto"], "tree_tokens_per_s": tps["tree"],
            "plain_tokens_per_s": tps["plain"], "speedup": tps["auto"] / max(tps["plain"], 1e-9),
            "tree_speedup": tps["tree"] / max(tps["plain"], 1e-9), "auto_rounds": dict(auto_rounds),
            "tree_tau_by_set": {name: 1 + accepted[name] / rounds[name] for name in rounds if rounds[name]},
            "prompts": len(prompts)}


def _evaluate_drafts(config: RetrainConfig, sources: dict, tracking_uri: str, beacon=None,
                     references: dict | None = None) -> dict:
    """{name: evaluate_draft(...)} for drafts named by registry URIs, sharing one target load and one prompt set
    (one machine, the same prompts: the comparison is fair). The prompts are built here, beside the target: second
    turns follow its own answers, and long contexts are measured with its tokenizer. With the serving gate on, each
    result also holds `serving_gate` (`serving_gates`; `references`: {name: the draft's training checkpoint folder})."""
    from eagle_core.checkpoint import load_draft
    from eagle_core.target import default_device, load_target
    from pipelines.cluster import use_assigned_cpus
    from pipelines.feature_files import DTYPE_NAMES
    from pipelines.prompt_sets import prompt_set, target_answerer

    def tick():  # progress for the driver's lease (a beacon actor it polls), when it holds one
        if beacon is not None:
            beacon.tick.remote()

    use_assigned_cpus()
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri  # the driver's store: the registry URIs resolve through it
    target, tokenizer = load_target(config.target, device=default_device())
    tick()
    prompts, _ = prompt_set(config.eval_prompts, tokenizer, config.eval_count, 0,
                            answer=target_answerer(target, tokenizer, config.eval_max_new_tokens))
    traffic = traffic_prompts(config.traffic, config.traffic_eval_fraction, config.eval_count) if config.traffic \
        else None  # with traffic: its held-out slice too, as result[TRAFFIC_SET]
    tick()
    results, folders = {}, {}
    for name, source in sources.items():
        folders[name] = resolve_source(source)
        draft = load_draft(folders[name], target=target)
        results[name] = evaluate_draft(target, tokenizer, draft, prompts, config, on_progress=tick)
        results[name]["dtype"] = DTYPE_NAMES[target.dtype]  # tau depends on it (TAU_DTYPE_TAG)
        if traffic:
            results[name][TRAFFIC_SET] = {"tau": traffic_tau(target, tokenizer, draft, traffic, config),
                                          "prompts": len(traffic)}
            tick()
    if config.serving_gate != "off":
        gates = serving_gates(config, target, tokenizer, prompts, folders, references or {}, on_progress=tick)
        for name, gate in gates.items():
            results[name]["serving_gate"] = gate.to_dict()
    return results


def serving_gates(config: RetrainConfig, target, tokenizer, prompts: list[dict], folders: dict, references: dict,
                  on_progress=None) -> dict:
    """{name: GateResult} of the serving-engine gate for the drafts in `folders` (local folders of the registry's
    versions) on the evaluation's prompts: our decoder's chain of depth k first (of the draft as trained:
    `references[name]`, a training checkpoint's draft folder, where it exists), then the target is released and
    each draft runs in vLLM. Skipped (said in each result) where vLLM is not installed or cannot load the target."""
    from eagle_core.chat import prompt_ids
    from eagle_core.checkpoint import load_draft
    from eagle_core.target import materialize_hf_folder
    from pipelines.feature_files import DTYPE_NAMES
    from pipelines.serving_gate import (GateResult, ServingGateUnavailable, chain_tau, check_gate_mode, gate_k,
                                        measure, release, target_refusal)
    from pipelines.storage import exists

    skipped = check_gate_mode(config.serving_gate)
    if skipped is None:
        folder = materialize_hf_folder(config.target)
        refusal = target_refusal(folder)
        if refusal and config.serving_gate == "vllm":
            raise ServingGateUnavailable(f"--serving-gate vllm: {refusal}")
        skipped = refusal and f"vLLM cannot load the target: {refusal}"
    if skipped:
        return {name: GateResult(draft=name, skipped=skipped) for name in folders}
    ids = [item["ids"] if "ids" in item else prompt_ids(tokenizer, item["messages"]) for item in prompts]
    ours = {}
    for name, export in folders.items():
        reference = references.get(name)
        if reference is not None and not exists(reference):
            print(f"[retrain] serving gate: {name}'s training checkpoint {reference} is gone; our decoder measures "
                  "the registered draft itself", flush=True)
            reference = None
        if reference is not None:
            from eagle_core.target import local_folder

            reference = local_folder(reference)
        k = gate_k(reference or export, config.serving_gate_k)
        draft = load_draft(reference or export, target=target).eval()
        tau = chain_tau(target, draft, ids, k, config.eval_max_new_tokens, tokenizer.eos_token_id)
        ours[name] = (reference, k, tau)
        del draft
        if on_progress is not None:
            on_progress()
    dtype, target_config, eos = DTYPE_NAMES[target.dtype], target.config, tokenizer.eos_token_id
    release(target)  # vLLM sizes its cache from the memory left (a GPU)
    gates = {}
    for name, export in folders.items():
        reference, k, tau = ours[name]
        gates[name] = measure(folder, export, ids, k, config.eval_max_new_tokens, eos, dtype, tau, name=name,
                              reference_folder=reference, target_config=target_config)
        if on_progress is not None:
            on_progress()
    return gates


class ProgressBeacon:
    """A counter an evaluation task ticks and its driver polls (a Ray actor: the task runs on another node)."""

    def __init__(self):
        self.count = 0

    def tick(self) -> None:
        self.count += 1

    def read(self) -> int:
        return self.count


class EvaluationTimeout(PromotionConflict):
    """The champion's re-evaluation under the lock did not finish within `eval_timeout_s`."""


def evaluate_on_worker(config: RetrainConfig, sources: dict, lease: PromotionLease | None = None,
                       timeout_s: float | None = None, references: dict | None = None) -> dict:
    """`_evaluate_drafts` as a Ray task with the target's resources (on a GPU node where the cluster has GPUs).

    With `lease` (an evaluation under the promotion lock) the task ticks a beacon actor after the target's load
    and after each prompt; each tick seen here is `lease.progress()`, so the lease outlives a slow evaluation
    but not a stalled one. With `timeout_s` the task is cancelled past it and EvaluationTimeout raised.
    `references`: {name: training checkpoint folder} for the serving gate (`_evaluate_drafts`)."""
    import ray

    from pipelines import tracking

    gpus = config.eval_gpus
    if gpus is None:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    task = ray.remote(num_cpus=config.eval_cpus, num_gpus=gpus)(_evaluate_drafts)
    beacon = ray.remote(num_cpus=0)(ProgressBeacon).remote() if lease is not None else None
    ref = task.remote(config, sources, tracking.tracking_uri(), beacon, *([references] if references else []))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    poll = 5.0 if lease is None else max(0.1, min(5.0, lease.ttl_s / 6))
    seen = 0
    try:
        while True:
            wait = poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic()))
            ready, _ = ray.wait([ref], timeout=wait)
            if ready:
                return ray.get(ref)
            if beacon is not None:
                ticks = ray.get(beacon.read.remote(), timeout=60)
                if ticks > seen:
                    seen = ticks
                    lease.progress()
            if deadline is not None and time.monotonic() >= deadline:
                ray.cancel(ref, force=True)
                raise EvaluationTimeout(f"the evaluation of {sorted(sources)} did not finish within {timeout_s:.0f} s "
                                        "(eval_timeout_s); it was cancelled and nothing was changed")
    finally:
        if beacon is not None:
            ray.kill(beacon)
