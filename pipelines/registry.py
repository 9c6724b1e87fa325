"""The draft registry's aliases, moved only by compare-and-set under a lease held in the registry itself.

Serving and warm starts load `models:/<name>@champion`, so moving that alias is the one decision that must never
be taken on stale information:

- `alias_version` answers "no such alias" only when the registry says so; any other failure (a timeout, a
  refused connection, a 5xx) raises `RegistryUnavailable` naming the tracking server, so a blinking server stops
  a run instead of making it believe there is no champion.
- `PromotionLease` is a lock on one registered model's aliases that needs nothing but the tracking server (no
  Kubernetes, no shared disk): holding it means having created the registered model `<name>.promotion-lock`,
  which the registry does atomically (a second create fails with RESOURCE_ALREADY_EXISTS on its unique name).
  Its tags name the owner and an expiry that a heartbeat thread renews; a lock whose holder died expires and is
  taken over.
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
LOCK_SUFFIX = ".promotion-lock"

log = logging.getLogger(__name__)


class RegistryUnavailable(RuntimeError):
    """The tracking server did not answer (or answered an error other than "does not exist")."""


class PromotionConflict(RuntimeError):
    """The decision could not be taken safely (the lease was lost, or the champion kept moving)."""


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

    Acquire: create that model with tags {owner, expires}; the registry refuses a second create, so exactly one
    process holds it. While held, a heartbeat renews `expires` every ttl/3. A lock whose `expires` passed (its
    holder died) is deleted and created anew, after re-reading that the same stale owner still holds it. Release
    deletes it if this process still owns it. `verify()` before acting re-reads the owner."""

    def __init__(self, name: str, ttl_s: float = 600.0, wait_s: float = 1800.0, poll_s: float = 1.0):
        self.model, self.lock = name, name + LOCK_SUFFIX
        self.ttl_s, self.wait_s, self.poll_s = ttl_s, wait_s, poll_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def _tags(self) -> dict:
        return {"owner": self.owner, "expires": f"{time.time() + self.ttl_s:.3f}"}

    def acquire(self) -> "PromotionLease":
        from mlflow.exceptions import MlflowException

        c = client()
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                c.create_registered_model(self.lock, tags=self._tags(),
                                          description=f"promotion lock of {self.model}; held by {self.owner}")
                break
            except MlflowException as err:
                if _error_code(err) != "RESOURCE_ALREADY_EXISTS":
                    raise _unavailable(f"taking the promotion lock {self.lock!r}", err) from err
            holder = self._holder()
            if holder is not None and holder[1] < time.time():
                self._break(holder[0])
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

    def _holder(self) -> tuple[str, float] | None:
        """(owner, expires) of the lock, None when it is gone."""
        from mlflow.exceptions import MlflowException

        try:
            tags = client().get_registered_model(self.lock).tags or {}
        except MlflowException as err:
            if _error_code(err) == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise _unavailable(f"reading the promotion lock {self.lock!r}", err) from err
        try:
            expires = float(tags.get("expires", "0"))
        except ValueError:
            expires = 0.0
        return tags.get("owner", "?"), expires

    def _break(self, stale_owner: str) -> None:
        """Delete an expired lock, unless its owner changed since we read it (someone else took it over)."""
        from mlflow.exceptions import MlflowException

        holder = self._holder()
        if holder is None or holder[0] != stale_owner or holder[1] >= time.time():
            return
        log.warning("promotion lock %s held by %s expired; taking it over", self.lock, stale_owner)
        try:
            client().delete_registered_model(self.lock)
        except MlflowException as err:
            if _error_code(err) != "RESOURCE_DOES_NOT_EXIST":
                raise _unavailable(f"removing the expired promotion lock {self.lock!r}", err) from err

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                client().set_registered_model_tag(self.lock, "expires", f"{time.time() + self.ttl_s:.3f}")
            except Exception as err:  # noqa: BLE001 - a blink of the server: the next beat retries
                log.warning("could not renew the promotion lock %s: %s", self.lock, err)

    def verify(self) -> None:
        """Raise PromotionConflict unless this process still holds an unexpired lock."""
        holder = self._holder()
        if holder is None or holder[0] != self.owner or holder[1] < time.time():
            raise PromotionConflict(f"lost the promotion lock {self.lock!r} (now held by "
                                    f"{holder[0] if holder else 'nobody'}); the champion was not changed")

    def release(self) -> None:
        from mlflow.exceptions import MlflowException

        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        try:
            holder = self._holder()
            if holder is not None and holder[0] == self.owner:
                client().delete_registered_model(self.lock)
        except (MlflowException, RegistryUnavailable) as err:  # it expires on its own after ttl_s
            log.warning("could not release the promotion lock %s (it expires by itself): %s", self.lock, err)

    def __enter__(self) -> "PromotionLease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --------------------------------------------------------------------------------------------------
# Compare-and-set promotion, rollback
# --------------------------------------------------------------------------------------------------

@dataclass
class Decision:
    promoted: bool
    champion_version: str | None  # the champion the new version was finally compared with
    champion_tau: float | None
    moved: int  # times the champion had moved since the caller's comparison (each re-evaluated)


def decide_promotion(name: str, version, new_tau: float, observed: str | None, observed_tau: float | None,
                     margin: float, evaluate_champion: Callable[[str], float], lease: PromotionLease | None = None,
                     max_moves: int = 3) -> Decision:
    """Compare-and-set: under the lease, re-read `name@champion`; if it is no longer `observed` (the version the
    caller evaluated, None for no champion), evaluate the new champion (`evaluate_champion(version) -> tau`) and
    compare again; then alias `version` champion when its tau beats the champion's by `margin`, else candidate.
    The new champion is tagged with the version it replaced. Every decision tags `version` with the champion it
    was compared with (DECIDED_AGAINST_TAG)."""
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
            champion_tau = None if current is None or current == version else float(evaluate_champion(current))
            observed = current
        if observed == version:  # already the champion (a rerun of a run that promoted it): nothing to compare
            champion_tau = None
        promoted = champion_tau is None or new_tau > champion_tau + margin
        lease.verify()  # the alias moves only while this process holds the lock
        c.set_model_version_tag(name, version, "tau", f"{new_tau:.4f}")
        c.set_model_version_tag(name, version, DECIDED_AGAINST_TAG, observed or "none")
        if promoted and observed not in (None, version):
            c.set_model_version_tag(name, version, PREVIOUS_CHAMPION_TAG, observed)
        c.set_registered_model_alias(name, CHAMPION if promoted else CANDIDATE, version)
    return Decision(promoted, observed, champion_tau, moved)


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
        c.set_registered_model_alias(name, CHAMPION, previous)
        return str(current.version), previous
