"""Where a trained draft comes from: the target, the features (and their manifest and extraction run), the run.

It is recorded three times: in the draft's config.json (`DraftConfig.extra`, without the aux layer ids, which the
draft config holds itself), in the MLflow run's params and tags, and in the job's summary.json.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import fsspec

from pipelines.storage import join


@dataclass
class Lineage:
    target: str
    features: str  # an extraction output URL, several joined by " + " (mixed sources), or "stream:<corpus>"
    aux_layer_ids: list[int]
    target_weights_hash: str | None = None
    features_manifest_sha256: str | None = None
    features_mlflow_run_id: str | None = None  # the extraction's MLflow run
    train_mlflow_run_id: str | None = None  # this training's MLflow run

    @classmethod
    def of_features(cls, features: str, manifest) -> "Lineage":
        """The lineage of a draft trained on the extraction output `features` (its `FeatureManifest`)."""
        return cls(target=manifest.target, features=features, aux_layer_ids=list(manifest.aux_layer_ids),
                   target_weights_hash=manifest.target_weights_hash,
                   features_manifest_sha256=manifest_digest(features),
                   features_mlflow_run_id=manifest.mlflow_run_id)

    @classmethod
    def of_sources(cls, urls: list[str], manifests: list) -> "Lineage":
        """The lineage of a draft trained on several mixed features sources: their URLs and manifest digests
        joined, the first source's target and extraction run."""
        first = cls.of_features(urls[0], manifests[0])
        first.features = " + ".join(urls)
        first.features_manifest_sha256 = ",".join(manifest_digest(url) for url in urls)
        return first

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Lineage":
        return cls(**data)

    def draft_extra(self) -> dict:
        """What the draft's config.json keeps (`DraftConfig.extra`)."""
        return {k: v for k, v in self.to_json().items() if k != "aux_layer_ids"}


def manifest_digest(features: str) -> str:
    with fsspec.open(join(features, "manifest.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
