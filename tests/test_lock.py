"""The promotion lock and `champion`: a holder that stalls loses the lock and another driver promotes; racing
takeovers of an expired lock leave exactly one holder; nothing moves `champion` past a champion newer than the
one its writer observed (registration, the demo).

Against an MLflow SQLite store in the test's folder: the lock needs only the registry's unique model names."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest


@pytest.fixture
def store(tmp_path):
    from pipelines import tracking

    saved = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.configure()
    yield
    if saved is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = saved
    tracking.configure()


def register(folder: Path, name: str, alias: str | None = None, **kwargs) -> str:
    from pipelines.retrain import register_draft_folder

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"draft": folder.name}))
    return str(register_draft_folder(str(folder), name, alias, experiment="lock-tests", **kwargs))


def champion_of(name: str) -> str | None:
    from pipelines.registry import CHAMPION, alias_version

    version = alias_version(name, CHAMPION)
    return None if version is None else str(version.version)


def test_a_holder_whose_evaluation_hangs_loses_the_lock_and_another_driver_promotes(store, tmp_path):
    """Driver A holds the lock and re-evaluates the champion, which hangs (no progress). Its lease is no longer
    renewed, so driver B takes the lock while A still hangs and promotes; when A wakes up it finds the lock lost
    and changes nothing."""
    from pipelines.promotion_lock import PromotionConflict, PromotionLease
    from pipelines.registry import CHAMPION, decide_promotion

    name = "hung"
    v1 = register(tmp_path / "v1", name, CHAMPION)
    v2, v3 = register(tmp_path / "v2", name), register(tmp_path / "v3", name)
    evaluating, wake, outcome = threading.Event(), threading.Event(), {}

    def hung_evaluation(version: str) -> float:
        evaluating.set()
        wake.wait(300)  # never reports progress
        return 1.0

    def driver_a():
        try:  # A compared against no champion: v1 is new to it, so it re-evaluates v1 under the lock
            outcome["a"] = decide_promotion(name, v2, 2.0, None, None, 0.05, hung_evaluation,
                                            PromotionLease(name, ttl_s=2, poll_s=0.2))
        except Exception as err:  # noqa: BLE001 - the test inspects it
            outcome["a"] = err

    a = threading.Thread(target=driver_a, daemon=True)
    a.start()
    try:
        assert evaluating.wait(120)
        b = decide_promotion(name, v3, 1.9, v1, 1.5, 0.05, lambda v: 1.5,
                             PromotionLease(name, ttl_s=30, wait_s=30, poll_s=0.2))
        assert not wake.is_set() and a.is_alive()  # B decided while A still hung
        assert b.promoted and champion_of(name) == v3
    finally:
        wake.set()
    a.join(120)
    assert isinstance(outcome["a"], PromotionConflict) and "lost the promotion lock" in str(outcome["a"])
    assert champion_of(name) == v3  # A, awake again, moved nothing


def test_two_takeovers_of_an_expired_lock_at_once_leave_exactly_one_holder(store, monkeypatch):
    """Two drivers find the same expired lock. The interleaving that breaks a read-then-delete takeover is
    forced: both have read the lock as expired before either deletes, and the second delete comes after the
    first driver has already taken the lock anew. Only the version read may be deleted, so one driver holds."""
    from mlflow import MlflowClient

    from pipelines.promotion_lock import LOCK_SUFFIX, PromotionConflict, PromotionLease
    from pipelines.registry_client import client

    lock = "race" + LOCK_SUFFIX
    client().create_registered_model(lock, tags={"owner": "dead-host:1:0123abcd", "expires": f"{time.time() - 1}"})
    real_create, real_delete = MlflowClient.create_registered_model, MlflowClient.delete_registered_model
    both_read, taken, guard, deletes = threading.Barrier(2, timeout=3), threading.Event(), threading.Lock(), []

    def create(self, model, *args, **kwargs):
        out = real_create(self, model, *args, **kwargs)
        if model == lock:
            taken.set()
        return out

    def delete(self, model):
        if model == lock:
            try:  # both takeovers read the lock as expired before either deletes it
                both_read.wait()
            except threading.BrokenBarrierError:
                pass  # only one takeover got this far
            with guard:
                deletes.append(model)
                second = len(deletes) == 2
            if second:  # the later delete lands after the other driver took the lock anew
                taken.wait(30)
        return real_delete(self, model)

    monkeypatch.setattr(MlflowClient, "create_registered_model", create)
    monkeypatch.setattr(MlflowClient, "delete_registered_model", delete)
    held = {}

    def take(n: int):
        lease = PromotionLease("race", ttl_s=60, wait_s=6, poll_s=0.2)
        try:
            held[n] = lease.acquire()
        except PromotionConflict:
            held[n] = None

    threads = [threading.Thread(target=take, args=(n,), daemon=True) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    holders = [lease for lease in held.values() if lease is not None]
    try:
        assert len(held) == 2 and len(holders) == 1, held
        holders[0].verify()
    finally:
        for lease in holders:
            lease.release()


def test_registration_and_the_demo_cannot_move_champion_past_a_newer_one(store, tmp_path, monkeypatch):
    import argparse

    import eagle_core.shipped
    import pipelines.retrain
    from jobs import demo
    from pipelines.promotion_lock import PromotionConflict

    name = demo.REGISTERED_MODEL
    first = register(tmp_path / "v1", name, "champion")  # the first champion: there was none
    with pytest.raises(PromotionConflict, match=f"is version {first}"):
        register(tmp_path / "v2", name, "champion")  # its writer expected no champion: a newer one exists
    assert champion_of(name) == first
    third = register(tmp_path / "v3", name, "champion", expected_champion=first)  # it saw v1: v1 is replaced
    assert champion_of(name) == third

    # The demo read "no champion" just before another process registered one: it keeps that champion.
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "config.json").write_text("{}")
    monkeypatch.setattr(eagle_core.shipped, "shipped_draft", lambda target: shipped)
    monkeypatch.setattr(pipelines.retrain, "alias_version", lambda *args: None)
    demo.champion_step(argparse.Namespace(target="smollm2-135m"))
    assert champion_of(name) == third


def test_the_evaluation_under_the_lock_reports_progress_and_is_cancelled_past_its_deadline(ray_cluster, tmp_path,
                                                                                            monkeypatch):
    """The champion's re-evaluation (a Ray task) ticks a beacon; the driver turns each tick into the lease's
    progress. One that never finishes is cancelled at its deadline and the decision fails."""
    import pipelines.retrain.evaluate as retrain_eval
    from pipelines.retrain import RetrainConfig
    from pipelines.retrain.evaluate import EvaluationTimeout, evaluate_on_worker

    seen = tmp_path / "progress-seen"

    class Lease:  # records progress where the evaluation task can see it
        ttl_s = 1.2

        def progress(self):
            seen.touch()

    def ticking(config, sources, tracking_uri, beacon):
        import os
        import time

        beacon.tick.remote()
        for _ in range(600):  # returns once the driver has turned the tick into the lease's progress
            if os.path.exists(seen):
                return {"champion": {"tau": 1.25}}
            time.sleep(0.1)
        raise AssertionError("the driver never reported the evaluation's progress to the lease")

    def hung(config, sources, tracking_uri, beacon):
        import time

        time.sleep(3600)

    config = RetrainConfig(eval_cpus=0.5, eval_gpus=0)
    monkeypatch.setattr(retrain_eval, "_evaluate_drafts", ticking)
    assert evaluate_on_worker(config, {"champion": "unused"}, lease=Lease(), timeout_s=120) == {
        "champion": {"tau": 1.25}}
    monkeypatch.setattr(retrain_eval, "_evaluate_drafts", hung)
    with pytest.raises(EvaluationTimeout, match="did not finish within 2 s"):
        evaluate_on_worker(config, {"champion": "unused"}, lease=Lease(), timeout_s=2)
