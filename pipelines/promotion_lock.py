"""The promotion lock: `PromotionLease`, the exclusive right to move one registered draft's aliases, held in the
registry itself (`pipelines.registry` moves `champion` only under it).

It needs nothing but the tracking server (no Kubernetes, no shared disk): holding it means having created the
registered model `<name>.promotion-lock`, which the registry does atomically (a second create fails with
RESOURCE_ALREADY_EXISTS on its unique name). Its tags name the owner and an expiry that a heartbeat renews only
while the holder makes progress; a lock whose holder died or stalls expires and is taken over, and only the version
that was read is ever deleted.

A lock that this identity may not write (another MLflow user created it, say the serving reader under basic auth)
could never be renewed, taken over nor deleted: a probe (a tag write) refuses it at once (`ForeignLock`, naming
it) instead of waiting for an expiry that never comes.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from pipelines.registry_client import client, error_code, server, unavailable

LOCK_SUFFIX = ".promotion-lock"

log = logging.getLogger(__name__)


class PromotionConflict(RuntimeError):
    """The decision could not be taken safely (the lease was lost, or the champion kept moving)."""


class ForeignLock(PromotionConflict):
    """The promotion lock exists and this identity may not write it: another MLflow user created it."""


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
                if error_code(err) == "RESOURCE_DOES_NOT_EXIST":
                    continue  # the lock was there and was released while the server answered: try again
                if error_code(err) != "RESOURCE_ALREADY_EXISTS":
                    raise unavailable(f"taking the promotion lock {self.lock!r}", err) from err
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
            if error_code(err) not in ("PERMISSION_DENIED", "UNAUTHENTICATED"):
                # released meanwhile, or a racing trainer's write in the way: not a verdict; the loop goes on and
                # checks again (the server being down is the lease's own calls' to report)
                log.debug("promotion lock %s not checked (%s); checking again", self.lock, error_code(err))
                return False
            raise ForeignLock(
                f"the promotion lock {self.lock!r} (held by {owner}) exists on {server()} but this identity "
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
            if error_code(err) == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise unavailable(f"reading {model!r}", err) from err

    def _delete_if_held_by(self, owner: str) -> bool:
        """Delete the lock if (and only if) it is the version `owner` took; True when this call deleted it."""
        from mlflow.exceptions import MlflowException

        c = client()
        marker = f"{self.lock}.taken-{_token_of(owner)}"
        try:
            c.create_registered_model(marker, tags={"by": self.owner, "expires": f"{time.time() + self.ttl_s:.3f}"},
                                      description=f"deleting {self.lock} as held by {owner}")
        except MlflowException as err:
            if error_code(err) == "RESOURCE_DOES_NOT_EXIST":
                return False  # another process's marker was there and went: it deleted that version
            if error_code(err) != "RESOURCE_ALREADY_EXISTS":
                raise unavailable(f"marking the promotion lock {self.lock!r} for deletion", err) from err
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
            if error_code(err) != "RESOURCE_DOES_NOT_EXIST":
                raise unavailable(f"removing {model!r}", err) from err

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
