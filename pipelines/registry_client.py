"""The MLflow client that the draft registry (`pipelines.registry`) and its promotion lock
(`pipelines.promotion_lock`) talk through, and what its failures mean.

A call that fails for any reason other than the registry's "does not exist" (a timeout, a refused connection, a
5xx) becomes `RegistryUnavailable` (`unavailable`), naming the tracking server: a blinking server stops a run
instead of making it believe there is no champion or no lock.
"""

from __future__ import annotations


class RegistryUnavailable(RuntimeError):
    """The tracking server did not answer (or answered an error other than "does not exist")."""


def client():
    from pipelines import tracking

    return tracking.configure().tracking.MlflowClient()


def server() -> str:
    from pipelines import tracking

    return tracking.tracking_uri()


def unavailable(what: str, err: Exception) -> RegistryUnavailable:
    return RegistryUnavailable(f"the MLflow tracking server at {server()} failed while {what}: {err}. Nothing "
                               "was changed; check the server (MLFLOW_TRACKING_URI) and rerun")


def error_code(err: Exception) -> str | None:
    return getattr(err, "error_code", None)
