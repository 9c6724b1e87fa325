"""A draft registered with its evaluation tau (`register_draft_folder(..., tau=)`, the shipped draft's first
registration in bench/traffic_loop.py) is tagged as a promotion tags one, and a serving replica's drift rule reads
that tag as its reference (`pipelines.serve.acceptance_report.reference_tau`); without tau there is no tag and no
drift rule. The dtype tau was measured in is tagged beside it, and a replica serving another dtype is warned that
its rule compares across dtypes. The session's own MLflow store (tests/conftest.py)."""

import json
import logging

from pipelines.registry import CHAMPION, register_draft_folder
from pipelines.registry_client import client
from pipelines.serve.acceptance_report import reference_tau
from pipelines.serve.config import ServeConfig


def test_a_registered_tau_is_the_drift_rules_reference(tmp_path, caplog):
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"note": "tau"}))
    name = "registered-tau-test"
    version = str(register_draft_folder(str(folder), name, CHAMPION, experiment="registry-tau-tests", tau=1.87654,
                                        tau_dtype="bfloat16"))
    tags = client().get_model_version(name, version).tags
    assert (tags["tau"], tags["eagle3.tau_dtype"]) == ("1.8765", "bfloat16")
    config = ServeConfig(draft=f"models:/{name}@{CHAMPION}")
    with caplog.at_level(logging.WARNING, logger="pipelines.serve.acceptance_report"):
        assert reference_tau(config, version, "bfloat16") == 1.8765
        assert not caplog.records  # measured as served: no warning
        assert reference_tau(config, version, "float32") == 1.8765  # still the reference, with a warning
    assert [r.getMessage() for r in caplog.records if "measured in bfloat16; this replica serves float32"
            in r.getMessage()], caplog.text

    plain = str(register_draft_folder(str(folder), name, None, experiment="registry-tau-tests"))
    assert "tau" not in (client().get_model_version(name, plain).tags or {})
    assert reference_tau(config, plain) is None
