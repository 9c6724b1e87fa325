"""The registry's champion under faults and races, against a real `mlflow server` on 127.0.0.1.

Properties: only "does not exist" reads as "no champion" (a stopped or hung tracking server stops a retraining run
before it works, naming the server, and the champion is unchanged); promotion is a compare-and-set under a lease
held in the registry, so drivers racing on one alias take exactly one decision per champion they observe and the
best draft ends as champion whatever the order; a promotion records the champion it replaced and `--rollback`
restores it; an expired lease is taken over, a live one is waited for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlflow_helpers import MlflowServer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("registry-server")
    srv = MlflowServer(folder)
    srv.start()
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                                            "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    # A failed call fails fast here; a deployment keeps MLflow's retries (minutes) and still gets the same error.
    os.environ.update(MLFLOW_TRACKING_URI=srv.uri, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
                      MLFLOW_HTTP_REQUEST_TIMEOUT="5")
    yield srv
    srv.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    from pipelines import tracking

    tracking.configure()  # back to whatever the session uses


def register(folder: Path, name: str, alias: str | None = None) -> str:
    from pipelines.retrain import register_draft_folder

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"note": name}))
    return str(register_draft_folder(str(folder), name, alias, experiment="registry-tests"))


def test_no_model_and_no_alias_are_none_a_stopped_or_hung_server_is_an_error(server, tmp_path):
    from pipelines.retrain import CHAMPION, RetrainConfig, alias_version, run_retrain
    from pipelines.registry_client import RegistryUnavailable

    assert alias_version("never-registered", CHAMPION) is None
    first = register(tmp_path / "d1", "blink", alias=None)
    assert alias_version("blink", CHAMPION) is None  # the model exists, the alias does not
    from pipelines.registry_client import client

    client().set_registered_model_alias("blink", CHAMPION, first)
    assert str(alias_version("blink", CHAMPION).version) == first

    config = RetrainConfig(corpus=str(tmp_path / "no-corpus.jsonl"), scales=[4], work=str(tmp_path / "work"),
                           registered_model="blink", eval_prompts=str(tmp_path / "no-prompts.jsonl"))
    server.pause()  # hung: the call times out
    try:
        start = time.monotonic()
        with pytest.raises(RegistryUnavailable, match=f"tracking server at {server.uri}"):
            run_retrain(config)
        assert time.monotonic() - start < 60
    finally:
        server.resume()
    server.stop()  # gone: the connection is refused
    try:
        with pytest.raises(RegistryUnavailable, match=f"tracking server at {server.uri}"):
            run_retrain(config)
        with pytest.raises(RegistryUnavailable, match=f"tracking server at {server.uri}"):
            alias_version("blink", CHAMPION)
    finally:
        server.start()
    assert not (tmp_path / "work").exists()  # stopped before extracting or training anything
    assert str(alias_version("blink", CHAMPION).version) == first  # the champion is unchanged


DRIVER = """
import json, sys, time
from pipelines.promotion_lock import PromotionLease
from pipelines.registry import decide_promotion
name, version, tau, observed, observed_tau, taus, start = json.loads(sys.argv[1])
def evaluate(v):  # the champion's evaluation (a decode on a worker in a real run) takes a while
    time.sleep(0.5)
    return taus[v]
time.sleep(max(0.0, start - time.time()))  # every driver reaches its decision at the same moment
d = decide_promotion(name, version, tau, observed, observed_tau, 0.05, evaluate, PromotionLease(name, poll_s=0.2))
print(json.dumps({"version": version, "promoted": d.promoted, "against": d.champion_version, "moved": d.moved}))
"""


def test_racing_drivers_decide_once_per_observed_champion_and_the_best_draft_wins(server, tmp_path):
    """Four drivers trained against champion v1 (tau 1.5) and decide at the same moment. Under the lease each sees
    the champion the previous decision left and re-evaluates it when it moved; so no two promotions replace the
    same champion, every decision compares with the champion of its moment, and the best draft (tau 2.0) ends as
    champion whatever the order, never a worse one that decided later."""
    from pipelines.registry import CHAMPION, DECIDED_AGAINST_TAG, PREVIOUS_CHAMPION_TAG, alias_version
    from pipelines.registry_client import client

    name = "race"
    champion = register(tmp_path / "v1", name, CHAMPION)
    taus = {champion: 1.5}
    drivers = []
    for i, tau in enumerate((1.7, 2.0, 1.6, 1.8)):
        version = register(tmp_path / f"n{i}", name, None)
        taus[version] = tau
        drivers.append((version, tau))
    start = time.time() + 8  # after every interpreter has imported MLflow
    # The drivers keep MLflow's own retries and timeout, as deployed drivers do: the module's fail-fast settings are
    # for the stopped and hung server above, and one slow answer on a loaded machine failed a driver with them.
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                                                             "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    env["PYTHONPATH"] = str(REPO)
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps([name, v, tau, champion, 1.5, taus, start])],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for v, tau in drivers]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    decisions = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]

    best = max(drivers, key=lambda d: d[1])[0]
    assert str(alias_version(name, CHAMPION).version) == best
    promoted_against = [d["against"] for d in decisions if d["promoted"]]
    assert len(set(promoted_against)) == len(promoted_against), decisions  # one promotion per observed champion
    c = client()
    for d in decisions:  # each decision is recorded on its version, against the champion it compared with
        assert c.get_model_version(name, d["version"]).tags[DECIDED_AGAINST_TAG] == d["against"]
        assert d["promoted"] == (taus[d["version"]] > taus[d["against"]] + 0.05), d
    assert sum(d["moved"] for d in decisions) >= 1  # at least one driver found the champion moved and re-evaluated
    # The promotions form one chain from v1: each new champion records the one it replaced.
    chain, v = [], best
    while v != champion:
        chain.append(v)
        v = c.get_model_version(name, v).tags[PREVIOUS_CHAMPION_TAG]
    assert [taus[x] for x in chain] == sorted((taus[x] for x in chain), reverse=True)

    # --rollback restores the champion the current one replaced, and again the one before it.
    from jobs.retrain import main

    assert main(["--rollback", "--registered-model", name]) == 0
    assert str(alias_version(name, CHAMPION).version) == c.get_model_version(name, best).tags[PREVIOUS_CHAMPION_TAG]


def test_an_expired_lease_is_taken_over_and_a_live_one_is_waited_for(server):
    from pipelines.promotion_lock import LOCK_SUFFIX, PromotionConflict, PromotionLease
    from pipelines.registry_client import client

    c = client()
    c.create_registered_model("lease" + LOCK_SUFFIX, tags={"owner": "dead-host:1:x", "expires": f"{time.time() - 1}"})
    with PromotionLease("lease", ttl_s=30) as held:
        held.verify()
        assert c.get_registered_model("lease" + LOCK_SUFFIX).tags["owner"] == held.owner
        with pytest.raises(PromotionConflict, match="held by"):
            PromotionLease("lease", wait_s=1.5, poll_s=0.3).acquire()
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException):  # released: the lock model is gone
        c.get_registered_model("lease" + LOCK_SUFFIX)


class _Answers:
    """The registry client, except that creating the lock gets, once, an answer the real server gives in a race:
    `gone` - "does not exist" (the server's create collided with a lock and re-read it after its holder deleted
    it; 3 in 135 colliding creates on this machine); `lost` - the create lands but its answer is lost, and MLflow's
    retry is told "already exists" about the caller's own lock."""

    def __init__(self, real, lock: str, answer: str):
        self.real, self.lock, self.answer = real, lock, answer

    def __getattr__(self, attr):
        return getattr(self.real, attr)

    def create_registered_model(self, name, *args, **kwargs):
        from mlflow.exceptions import RestException

        if name != self.lock or self.answer is None:
            return self.real.create_registered_model(name, *args, **kwargs)
        answer, self.answer = self.answer, None
        if answer == "lost":
            self.real.create_registered_model(name, *args, **kwargs)
            raise RestException({"error_code": "RESOURCE_ALREADY_EXISTS",
                                 "message": f"Registered Model (name={name}) already exists."})
        raise RestException({"error_code": "RESOURCE_DOES_NOT_EXIST",
                             "message": f"Registered Model with name={name} not found"})


@pytest.mark.parametrize("answer", ["gone", "lost"])
def test_the_lease_is_taken_through_the_servers_racy_answers_to_create(server, monkeypatch, answer):
    """Either answer to the create means the lock is free (gone) or ours (lost): the lease is taken at once, not
    refused as a server failure and not waited for until it expires."""
    from pipelines import promotion_lock
    from pipelines.promotion_lock import LOCK_SUFFIX, PromotionLease

    name = f"racy-{answer}"
    real = promotion_lock.client()
    patched = _Answers(real, name + LOCK_SUFFIX, answer)
    monkeypatch.setattr(promotion_lock, "client", lambda: patched)  # the client the lease calls
    with PromotionLease(name, wait_s=5, poll_s=0.2) as held:
        held.verify()
        assert patched.answer is None  # the racy answer was given
        assert real.get_registered_model(name + LOCK_SUFFIX).tags["owner"] == held.owner
    assert held._holder() is None  # released
