"""Fingerprints: an extraction output, each of its shards and its manifest record what made them.

`extraction_fingerprint` is what determines a shard's bytes besides its rows; `prepare_output` refuses an output
that another run made differently (or empties it: `overwrite`) and records this run's fingerprint before any shard
is written; `reuse_shards` copies planned shards from earlier outputs, refusing any made differently.
"""

from __future__ import annotations

import json

from pipelines.extract.config import ExtractConfig
from pipelines.feature_files import check_fingerprint, committed_shards, read_shard_summary
from pipelines.storage import commit_bytes, exists, join, read_bytes, url_to_fs

FINGERPRINT_FILE = "fingerprint.json"


def extraction_fingerprint(config: ExtractConfig, folder, target_config, device: str) -> dict:
    """What determines a shard's bytes besides its rows (whose ids its name hashes): the target's weights, its
    tokenizer and chat template (both read from the target's local `folder`), max_length, the hidden states' dtype
    on `device`, the aux layers, the regeneration settings and the corpus. Not `limit`: a shard of a prefix is the
    same shard of the whole."""
    from eagle_core.target import resolve_dtype
    from pipelines.engines import engine_fingerprint
    from pipelines.feature_files import target_fingerprint

    engine = engine_fingerprint(config.engine)  # none for hf (the reference): older hf outputs stay valid
    return {
        **target_fingerprint(folder, target_config, config.max_length, resolve_dtype(config.dtype, device),
                             config.aux_layer_ids),
        **({"engine": engine} if engine else {}),
        "regeneration": {"with": config.regenerate_with, "max_new_tokens": config.max_new_tokens,
                         "temperature": config.temperature, "seed": config.seed} if config.regenerate else None,
        "corpus": config.corpus,
    }


def prepare_output(config: ExtractConfig, fingerprint: dict) -> None:
    """Refuse an output that another run made differently (its fingerprint file, its manifest, any committed
    shard), naming the differing fields; with `overwrite`, empty it instead. Then record this run's fingerprint
    before any shard is written, so a run killed early is checked too."""
    fs, root = url_to_fs(config.output)
    if config.overwrite:
        for part in ("features", "regenerated", "quarantine", "manifest.json", FINGERPRINT_FILE):
            if fs.exists(f"{root}/{part}"):
                fs.rm(f"{root}/{part}", recursive=True)
    else:
        remedy = ("Extract into another --output, or replace what is there: --overwrite (jobs/extract.py), "
                  "--extract '{\"overwrite\": true}' (jobs/retrain.py).")
        if exists(join(config.output, FINGERPRINT_FILE)):  # written before any shard: it speaks for all of them
            check_fingerprint(json.loads(read_bytes(join(config.output, FINGERPRINT_FILE))), fingerprint,
                              f"the extraction output {config.output}", remedy)
        else:  # an output without one: its manifest and every committed shard say what made them
            if exists(join(config.output, "manifest.json")):
                from pipelines.feature_files import load_manifest

                check_fingerprint(load_manifest(config.output).fingerprint, fingerprint,
                                  f"the extraction output {config.output} (its manifest)", remedy)
            for name in sorted(committed_shards(config.output)):
                summary = read_shard_summary(join(config.output, "features", f"{name}.parquet"))
                check_fingerprint(summary.get("fingerprint"), fingerprint, f"shard {name} of {config.output}",
                                  remedy)
    commit_bytes(join(config.output, FINGERPRINT_FILE), json.dumps(fingerprint, indent=1).encode())


def reuse_shards(config: ExtractConfig, names: list[str], fingerprint: dict | None = None) -> list[str]:
    """Copy planned shards committed in `config.reuse_from` outputs into this output; returns their names. A
    shard made differently (its recorded fingerprint differs from `fingerprint`) is refused, naming the fields."""
    done = committed_shards(config.output)
    reused = []
    for source in config.reuse_from:
        available = committed_shards(source) - done
        for name in names:
            if name not in available:
                continue
            if fingerprint is not None:
                summary = read_shard_summary(join(source, "features", f"{name}.parquet"))
                check_fingerprint(summary.get("fingerprint"), fingerprint, f"shard {name} of {source} (reuse_from)",
                                  f"Drop {source} from reuse_from, or re-extract it with this run's settings.")
            regenerated = join(source, "regenerated", f"{name}.jsonl")
            if config.regenerate and exists(regenerated):
                commit_bytes(join(config.output, "regenerated", f"{name}.jsonl"), read_bytes(regenerated))
            commit_bytes(join(config.output, "features", f"{name}.parquet"),
                         read_bytes(join(source, "features", f"{name}.parquet")))
            done.add(name)
            reused.append(name)
    return reused
