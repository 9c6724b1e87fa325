"""The draft registry's aliases, moved only by compare-and-set under a lease held in the registry itself.

Serving and warm starts load `models:/<name>@champion`, so moving that alias is the one decision that must never
be taken on stale information:

- `alias_version` answers "no such alias" only when the registry says so; any other failure (a timeout, a
  refused connection, a 5xx) raises `RegistryUnavailable` (`pipelines.registry_client`) naming the tracking
  server, so a blinking server stops a run instead of making it believe there is no champion.
- `PromotionLease` (`pipelines.promotion_lock`) is a lock on one registered model's aliases that needs nothing
  but the tracking server, held as the registered model `<name>.promotion-lock`.
- Every move of `champion` (a promotion, a rollback, `set_champion` for a first or shipped draft) goes through
  `_move_alias` under the lease, after re-reading the champion: no writer moves it past a newer one.
- `decide_promotion` holds the lease for the whole decision: it re-reads the champion, re-evaluates against it
  when it moved since the run compared, then sets the alias, tagging the new champion with the one it replaced
  (`eagle3.previous_champion`) so that `rollback` can restore it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from pipelines.promotion_lock import PromotionConflict, PromotionLease
from pipelines.registry_client import client, error_code, unavailable

CHAMPION, CANDIDATE = "champion", "candidate"
PREVIOUS_CHAMPION_TAG = "eagle3.previous_champion"
DECIDED_AGAINST_TAG = "eagle3.decided_against"  # the champion version a promotion decision compared with
ROLLED_BACK_TAG = "eagle3.rolled_back_to"
TAU_TAG = "tau"  # a version's evaluation tau (`decide_promotion`, `register_draft_folder`): the drift rule's reference
TAU_DTYPE_TAG = "eagle3.tau_dtype"  # the target dtype that tau was measured in (tau depends on it: near-ties flip)

log = logging.getLogger(__name__)


def alias_version(name: str, alias: str):
    """The ModelVersion that `name@alias` names, or None when the model or the alias does not exist.

    Two calls (the model, then the version its alias names) instead of `get_model_version_by_alias`, whose
    "alias not found" shares its error code (INVALID_PARAMETER_VALUE) with malformed requests: here only
    RESOURCE_DOES_NOT_EXIST, or an alias absent from the model's own alias map, means "none"."""
    from mlflow.exceptions import MlflowException

    c = client()
    try:
        model = c.get_registered_model(name)
    except MlflowException as err:
        if error_code(err) == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise unavailable(f"reading registered model {name!r}", err) from err
    except Exception as err:  # requests' and urllib3's own errors, when MLflow lets one through
        raise unavailable(f"reading registered model {name!r}", err) from err
    version = (model.aliases or {}).get(alias)
    if version is None:
        return None
    try:
        return c.get_model_version(name, str(version))
    except Exception as err:  # the alias names a version: its absence is an inconsistency, not "no champion"
        raise unavailable(f"reading version {version} of {name!r} (alias {alias!r})", err) from err


# --------------------------------------------------------------------------------------------------
# Compare-and-set promotion, rollback
# --------------------------------------------------------------------------------------------------

@dataclass
class Decision:
    promoted: bool
    champion_version: str | None  # the champion the new version was finally compared with
    champion_tau: float | dict | None  # a score as the caller gave them (`decide_promotion`)
    moved: int  # times the champion had moved since the caller's comparison (each re-evaluated)


def tag_evaluation(c, name: str, version: str, score: float | dict, tags: dict | None = None) -> None:
    """Tag `version` with its evaluation: a tau under TAU_TAG, or each named tau of a dict under its name (4
    decimals), and `tags` (how it was measured: TAU_DTYPE_TAG) as they are."""
    for key, tau in (score if isinstance(score, dict) else {TAU_TAG: score}).items():
        c.set_model_version_tag(name, version, key, f"{tau:.4f}")
    for key, value in (tags or {}).items():
        c.set_model_version_tag(name, version, key, str(value))


def decide_promotion(name: str, version, new_tau: float | dict, observed: str | None,
                     observed_tau: float | dict | None, margin: float, evaluate_champion: Callable[[str], float | dict],
                     lease: PromotionLease | None = None, max_moves: int = 3,
                     beats: Callable[[dict, dict], bool] | None = None, tags: dict | None = None) -> Decision:
    """Compare-and-set: under the lease, re-read `name@champion`; if it is no longer `observed` (the version the
    caller evaluated, None for no champion), evaluate the new champion (`evaluate_champion(version) -> tau`) and
    compare again; then alias `version` champion when its tau beats the champion's by `margin`, else candidate.
    The new champion is tagged with the version it replaced. Every decision tags `version` with the champion it
    was compared with (DECIDED_AGAINST_TAG). `evaluate_champion` runs under the lease: it must report progress
    (`lease.progress()`) at least once per `lease.ttl_s`, or the lease lapses and the decision ends in
    PromotionConflict with nothing changed.

    A score (the new version's, the champion's, what `evaluate_champion` returns) is a tau, or a dict of named
    taus (retraining from traffic: {"tau": on the base evaluation set, "traffic_tau": on held-out traffic}); each
    named tau is tagged on `version` under its name, with `tags` (how it was measured: TAU_DTYPE_TAG). `beats(new,
    champion)` decides between dict scores; None: new > champion + margin."""
    version = str(version)
    observed = None if observed is None else str(observed)
    lease = lease or PromotionLease(name)
    c = client()
    with lease:
        champion_tau, moved = observed_tau, 0
        while True:
            current = alias_version(name, CHAMPION)
            current = None if current is None else str(current.version)
            if current == observed:
                break
            moved += 1
            if moved > max_moves:
                raise PromotionConflict(f"the champion of {name!r} moved {max_moves} times while version {version} "
                                        "was being compared (someone promotes without the lock?); nothing changed")
            log.warning("champion of %s moved from %s to %s since version %s was evaluated; re-evaluating",
                        name, observed, current, version)
            print(f"[retrain] the champion moved from {observed} to {current} meanwhile: re-evaluating", flush=True)
            lease.progress()
            champion_tau = None if current is None or current == version else float(evaluate_champion(current))
            lease.progress()
            observed = current
        if observed == version:  # already the champion (a rerun of a run that promoted it): nothing to compare
            champion_tau = None
        promoted = champion_tau is None or (beats(new_tau, champion_tau) if beats is not None
                                            else new_tau > champion_tau + margin)
        lease.verify()  # the alias moves only while this process holds the lock
        tag_evaluation(c, name, version, new_tau, tags)
        c.set_model_version_tag(name, version, DECIDED_AGAINST_TAG, observed or "none")
        if promoted and observed not in (None, version):
            c.set_model_version_tag(name, version, PREVIOUS_CHAMPION_TAG, observed)
        _move_alias(lease, name, CHAMPION if promoted else CANDIDATE, version)
    return Decision(promoted, observed, champion_tau, moved)


def _move_alias(held: PromotionLease, name: str, alias: str, version: str) -> None:
    """The one place an alias of a registered draft moves: only while `held` is this process's, unexpired."""
    held.verify()
    client().set_registered_model_alias(name, alias, str(version))


def set_champion(name: str, version, expected: str | None, lease: PromotionLease | None = None) -> None:
    """Compare-and-set without an evaluation (registering a first champion, the demo's shipped draft): under the
    lease, point `name@champion` at `version` only if it still names `expected` (None: no champion yet);
    otherwise raise PromotionConflict naming the champion found, which stays."""
    version = str(version)
    expected = None if expected is None else str(expected)
    with lease or PromotionLease(name) as held:
        current = alias_version(name, CHAMPION)
        current = None if current is None else str(current.version)
        if current == version:
            return
        if current != expected:
            raise PromotionConflict(f"the champion of {name!r} is version {current}, not "
                                    f"{expected or 'none'} as expected; version {version} was not made champion")
        _move_alias(held, name, CHAMPION, version)


def rollback(name: str, lease: PromotionLease | None = None) -> tuple[str, str]:
    """Point `name@champion` back at the version the current champion replaced; returns (from, to)."""
    from mlflow.exceptions import MlflowException

    c = client()
    with lease or PromotionLease(name) as held:
        current = alias_version(name, CHAMPION)
        if current is None:
            raise ValueError(f"{name!r} has no champion to roll back")
        previous = (current.tags or {}).get(PREVIOUS_CHAMPION_TAG)
        if not previous:
            raise ValueError(f"champion version {current.version} of {name!r} records no previous champion "
                             f"(tag {PREVIOUS_CHAMPION_TAG}): nothing to roll back to")
        try:
            c.get_model_version(name, previous)
        except MlflowException as err:
            raise ValueError(f"the previous champion, version {previous} of {name!r}, is gone: {err}") from err
        held.verify()
        c.set_model_version_tag(name, str(current.version), ROLLED_BACK_TAG, previous)
        _move_alias(held, name, CHAMPION, previous)
        return str(current.version), previous


def register_draft_folder(folder: str, name: str, alias: str | None = CHAMPION, experiment: str = "eagle3-retrain",
                          run_name: str = "register-draft", expected_champion: str | None = None,
                          tau: float | None = None, tau_dtype: str | None = None) -> int:
    """Log a draft folder (e.g. the shipped one) as an MLflow run's artifacts and register it under `name`
    with `alias`; returns the new version. `tau`: its evaluation tau, tagged on the version as `decide_promotion`
    tags a promoted one (what a serving replica's drift rule compares with), before the version takes the alias;
    `tau_dtype`: the target dtype it was measured in.

    `champion` moves only by compare-and-set under the promotion lock (`registry.set_champion`): the version
    becomes champion only if the champion is still `expected_champion` (None: there is none), else
    PromotionConflict is raised and the champion found stays (the new version stays registered, without alias)."""
    from pipelines import tracking

    c = client()
    run_id = c.create_run(tracking.ensure_experiment(experiment), run_name=run_name).info.run_id
    c.log_param(run_id, "source", str(folder))
    c.log_artifacts(run_id, str(folder), "draft")
    c.set_terminated(run_id)
    version = tracking.register_artifact(run_id, "draft", name, None if alias == CHAMPION else alias)
    if tau is not None:
        tag_evaluation(c, name, str(version), tau, {TAU_DTYPE_TAG: tau_dtype} if tau_dtype is not None else None)
    if alias == CHAMPION:
        set_champion(name, version, expected_champion)
    return version
