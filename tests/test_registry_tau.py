"""A draft registered with its evaluation tau (`register_draft_folder(..., tau=)`, the shipped draft's first
registration in bench/traffic_loop.py) is tagged as a promotion tags one, and a serving replica's drift rule reads
that tag as its reference (`pipelines.serve.acceptance_report.reference_tau`); without tau there is no tag and no
drift rule. The session's own MLflow store (tests/conftest.py)."""

import json

from pipelines.registry import CHAMPION, client, register_draft_folder
from pipelines.serve.acceptance_report import reference_tau
from pipelines.serve.config import ServeConfig


def test_a_registered_tau_is_the_drift_rules_reference(tmp_path):
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"note": "tau"}))
    name = "registered-tau-test"
    version = str(register_draft_folder(str(folder), name, CHAMPION, experiment="registry-tau-tests", tau=1.87654))
    assert client().get_model_version(name, version).tags["tau"] == "1.8765"
    config = ServeConfig(draft=f"models:/{name}@{CHAMPION}")
    assert reference_tau(config, version) == 1.8765

    plain = str(register_draft_folder(str(folder), name, None, experiment="registry-tau-tests"))
    assert "tau" not in (client().get_model_version(name, plain).tags or {})
    assert reference_tau(config, plain) is None
