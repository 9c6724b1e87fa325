"""The draft registry's aliases, moved only by compare-and-set under a lease held in the registry itself.

Serving and warm starts load `models:/<name>@champion`, so moving that alias is the one decision that must never
be taken on stale information:

- `alias_version` answers "no such alias" only when the registry says so; any other failure (a timeout, a
  refused connection, a 5xx) raises `RegistryUnavailable` naming the tracking server, so a blinking server stops
  a run instead of making it believe there is no champion.
- `PromotionLease` is a lock on one registered model's aliases that needs nothing but the tracking server (no
  Kubernetes, no shared disk): holding it means having created the registered model `<name>.promotion-lock`,
  which the registry does atomically (a second create fails with RESOURCE_ALREADY_EXISTS on its unique name).
  Its tags name the owner and an expiry that a heartbeat renews only while the holder makes progress; a lock
  whose holder died or stalls expires and is taken over, and only the version that was read is ever deleted.
- Every move of `champion` (a promotion, a rollback, `set_champion` for a first or shipped draft) goes through
  `_move_alias` under the lease, after re-reading the champion: no writer moves it past a newer one.
- `decide_promotion` holds the lease for the whole decision: it re-reads the champion, re-evaluates against it
  when it moved since the run compared, then sets the alias, tagging the new champion with the one it replaced
  (`eagle3.previous_champion`) so that `rollback` can restore it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

CHAMPION, CANDIDATE = "champion", "candidate"
PREVIOUS_CHAMPION_TAG = "eagle3.previous_champion"
DECIDED_AGAINST_TAG = "eagle3.decided_against"  # the champion version a promotion decision compared with
ROLLED_BACK_TAG = "eagle3.rolled_back_to"
TAU_TAG = "tau"  # a version's evaluation tau (`decide_promotion`, `register_draft_folder`): the drift rule's reference
TAU_DTYPE_TAG = "eagle3.tau_dtype"  # the target dtype that tau was measured in (tau depends on it: near-ties flip)
LOCK_SUFFIX = ".promotion-lock"

log = logging.getLogger(__name__)


class RegistryUnavailable(RuntimeError):
    """The tracking server did not answer (or answered an error other than "does not exist")."""


class PromotionConflict(RuntimeError):
    """The decision could not be taken safely (the lease was lost, or the champion kept moving)."""


class ForeignLock(PromotionConflict):
    """The promotion lock exists and this identity may not write it: another MLflow user created it."""


def client():
    from pipelines import tracking

    return tracking.configure().tracking.MlflowClient()


def _server() -> str:
    from pipelines import tracking

    return tracking.tracking_uri()


def _unavailable(what: str, err: Exception) -> RegistryUnavailable:
    return RegistryUnavailable(f"the MLflow tracking server at {_server()} failed while {what}: {err}. Nothing "
                               "was changed; check the server (MLFLOW_TRACKING_URI) and rerun")


def _error_code(err: Exception) -> str | None:
    return getattr(err, "error_code", None)


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
        if _error_code(err) == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise _unavailable(f"reading registered model {name!r}", err) from err
    except Exception as err:  # requests' and urllib3's own errors, when MLflow lets one through
        raise _unavailable(f"reading registered model {name!r}", err) from err
    version = (model.aliases or {}).get(alias)
    if version is None:
        return None
    try:
        return c.get_model_version(name, str(version))
    except Exception as err:  # the alias names a version: its absence is an inconsistency, not "no champion"
        raise _unavailable(f"reading version {version} of {name!r} (alias {alias!r})", err) from err


# --------------------------------------------------------------------------------------------------
# The lease
# --------------------------------------------------------------------------------------------------

class PromotionLease:
    """Exclusive right to move `name`'s aliases, held as the registered model `<name>.promotion-lock`.

    Acquire: create that model with the tags `owner` (host:pid:token, `token` unique to this acquisition) and
    `expires_<token>`; the registry refuses a second create, so exactly one process holds it.

    The lease lives only while its holder makes progress: the holder calls `progress()` (the champion's
    evaluation does, per prompt), and a heartbeat every ttl/3 moves the expiry to the last progress + ttl. A
    holder that stalls (a hung evaluation) stops being renewed and loses the lock ttl after its last progress,
    though its process lives on. Expiry is keyed by the token, so a stalled holder that wakes up after a
    takeover writes a tag of its own version, never the new holder's expiry.

    Deleting a lock (a takeover of an expired one, or a release) is conditional on the version read: the deleter
    first creates the registered model `<name>.promotion-lock.taken-<token>` for the token it read (only one
    process can), re-reads the lock, and deletes it only if it still carries that token; since every delete of
    that version needs that same marker, the lock cannot change between the re-read and the delete. Two racing
    takeovers thus delete the expired version once and never the lock that one of them has just taken. A marker
    left by a process that died holding it expires after ttl and is removed. `verify()` before acting re-reads
    the owner.

    Two answers to a create are not what they say. "Does not exist": the server's insert collided with a lock
    (or marker) that was deleted before the server re-read it, so it is gone now. "Already exists" naming this
    process as owner: our create landed, its answer was lost and MLflow's retry collided with it."""

    def __init__(self, name: str, ttl_s: float = 600.0, wait_s: float = 1800.0, poll_s: float = 1.0):
        self.model, self.lock = name, name + LOCK_SUFFIX
        self.ttl_s, self.wait_s, self.poll_s = ttl_s, wait_s, poll_s
        self.token = uuid.uuid4().hex
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{self.token}"
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._progressed = time.time()

    def progress(self) -> None:
        """The holder did work: the next heartbeat extends the lease to ttl from now."""
        self._progressed = time.time()

    def acquire(self) -> "PromotionLease":
        from mlflow.exceptions import MlflowException

        c = client()
        deadline = time.monotonic() + self.wait_s
        checked = None
        while True:
            self.progress()
            try:
                c.create_registered_model(self.lock, tags={"owner": self.owner, _expires_key(self.token):
                                                           f"{self._progressed + self.ttl_s:.3f}"},
                                          description=f"promotion lock of {self.model}; held by {self.owner}")
                break
            except MlflowException as err:
                if _error_code(err) == "RESOURCE_DOES_NOT_EXIST":
                    continue  # the lock was there and was released while the server answered: try again
                if _error_code(err) != "RESOURCE_ALREADY_EXISTS":
                    raise _unavailable(f"taking the promotion lock {self.lock!r}", err) from err
            holder = self._holder()
            if holder is not None and holder[0] == self.owner:
                break  # our own create landed and its answer was lost: MLflow's retry found our lock
            if holder is not None and holder[0] != checked and self._check_writable(holder[0]):
                checked = holder[0]  # once per holder: a lock we could never take over is refused now
            if holder is not None and holder[1] < time.time():
                log.warning("promotion lock %s held by %s expired; taking it over", self.lock, holder[0])
                if not self._delete_if_held_by(holder[0]):
                    time.sleep(self.poll_s)  # another process is removing it (or has): try again shortly
                continue
            if time.monotonic() > deadline:
                raise PromotionConflict(f"the promotion lock {self.lock!r} is held by "
                                        f"{holder[0] if holder else 'another process'} for longer than "
                                        f"{self.wait_s:.0f} s; delete that registered model if its holder is gone")
            time.sleep(self.poll_s)
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._renew, name="promotion-lease", daemon=True)
        self._heartbeat.start()
        log.info("promotion lock %s taken by %s", self.lock, self.owner)
        return self

    def _check_writable(self, owner: str) -> bool:
        """Raise ForeignLock when this identity cannot write the lock. Under MLflow's basic auth the creator of a
        registered model gets MANAGE on it and other users only the server's default (READ), and any authenticated
        user may create registered models: a user who is not the trainers' (the serving reader, say) could create
        the lock with a far-future expiry, and the trainers could neither renew, take over nor delete it. Writing a
        tag of our own key is the probe (the trainers' own locks are theirs to write); a refusal names the lock
        at once instead of waiting `wait_s` for an expiry that never comes."""
        from mlflow.exceptions import MlflowException

        try:
            client().set_registered_model_tag(self.lock, "eagle3.seen_by", self.owner)
        except MlflowException as err:
            if _error_code(err) not in ("PERMISSION_DENIED", "UNAUTHENTICATED"):
                # released meanwhile, or a racing trainer's write in the way: not a verdict; the loop goes on and
                # checks again (the server being down is the lease's own calls' to report)
                log.debug("promotion lock %s not checked (%s); checking again", self.lock, _error_code(err))
                return False
            raise ForeignLock(
                f"the promotion lock {self.lock!r} (held by {owner}) exists on {_server()} but this identity "
                f"may not write it: another MLflow user created it, so no promotion of {self.model!r} could ever "
                f"take it over. Nothing was changed. An MLflow admin must delete the registered model "
                f"{self.lock!r}, and should keep users other than the trainers' from creating registered "
                f"models (docs/deployment.md)") from err
        return True

    def _holder(self) -> tuple[str, float] | None:
        """(owner, expires) of the lock, None when it is gone."""
        tags = self._tags_of(self.lock)
        if tags is None:
            return None
        owner = tags.get("owner", "?")
        try:  # (a lock taken by an older version of this code has one plain `expires` tag)
            expires = float(tags.get(_expires_key(_token_of(owner)), tags.get("expires", "0")))
        except ValueError:
            expires = 0.0
        return owner, expires

    def _tags_of(self, model: str) -> dict | None:
        from mlflow.exceptions import MlflowException

        try:
            return client().get_registered_model(model).tags or {}
        except MlflowException as err:
            if _error_code(err) == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise _unavailable(f"reading {model!r}", err) from err

    def _delete_if_held_by(self, owner: str) -> bool:
        """Delete the lock if (and only if) it is the version `owner` took; True when this call deleted it."""
        from mlflow.exceptions import MlflowException

        c = client()
        marker = f"{self.lock}.taken-{_token_of(owner)}"
        try:
            c.create_registered_model(marker, tags={"by": self.owner, "expires": f"{time.time() + self.ttl_s:.3f}"},
                                      description=f"deleting {self.lock} as held by {owner}")
        except MlflowException as err:
            if _error_code(err) == "RESOURCE_DOES_NOT_EXIST":
                return False  # another process's marker was there and went: it deleted that version
            if _error_code(err) != "RESOURCE_ALREADY_EXISTS":
                raise _unavailable(f"marking the promotion lock {self.lock!r} for deletion", err) from err
            tags = self._tags_of(marker) or {}
            if tags.get("by") == self.owner:  # our own create landed and its answer was lost (a retry)
                return self._delete_held_by(owner, marker)
            try:
                stale = float(tags.get("expires", "0")) < time.time()
            except ValueError:
                stale = True
            if tags and stale:  # its maker died between marking and deleting: clear the way for the next try
                self._delete_model(marker)
            return False  # another process is deleting this version (or it is gone)
        return self._delete_held_by(owner, marker)

    def _delete_held_by(self, owner: str, marker: str) -> bool:
        """Under this process's `marker`: delete the lock if it is still the version `owner` took, then the marker."""
        try:
            holder = self._holder()
            if holder is None or holder[0] != owner:
                return False  # that version is gone already: the lock there now is someone else's
            self._delete_model(self.lock)
            return True
        finally:
            self._delete_model(marker)

    def _delete_model(self, model: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            client().delete_registered_model(model)
        except MlflowException as err:
            if _error_code(err) != "RESOURCE_DOES_NOT_EXIST":
                raise _unavailable(f"removing {model!r}", err) from err

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            if time.time() - self._progressed > self.ttl_s:
                log.warning("promotion lock %s: no progress for %.0f s; no longer renewed", self.lock,
                            time.time() - self._progressed)
                continue  # a stalled holder lets the lock expire: another driver may take over
            try:
                client().set_registered_model_tag(self.lock, _expires_key(self.token),
                                                  f"{self._progressed + self.ttl_s:.3f}")
            except Exception as err:  # noqa: BLE001 - a blink of the server: the next beat retries
                log.warning("could not renew the promotion lock %s: %s", self.lock, err)

    def verify(self) -> None:
        """Raise PromotionConflict unless this process still holds an unexpired lock."""
        holder = self._holder()
        if holder is None or holder[0] != self.owner or holder[1] < time.time():
            raise PromotionConflict(f"lost the promotion lock {self.lock!r} (now held by "
                                    f"{holder[0] if holder else 'nobody'}); the champion was not changed")

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        try:
            self._delete_if_held_by(self.owner)
        except RegistryUnavailable as err:  # it expires on its own after ttl_s
            log.warning("could not release the promotion lock %s (it expires by itself): %s", self.lock, err)

    def __enter__(self) -> "PromotionLease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _token_of(owner: str) -> str:
    """The acquisition token of an owner string (host:pid:token); a malformed one is its own token."""
    token = owner.rsplit(":", 1)[-1]
    return token if token.isalnum() else uuid.uuid5(uuid.NAMESPACE_OID, owner).hex


def _expires_key(token: str) -> str:
    return f"expires_{token}"


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
