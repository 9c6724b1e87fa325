#!/bin/bash
# One retraining, submitted as a RayJob and waited for: the script of both CronJobs, the weekly one
# (infra/retrain-schedule.yaml) and the one that acts on drift alerts (infra/retrain-on-drift.yaml). It lives in the
# ConfigMap eagle3-retrain-rayjob beside the RayJob it creates:
#   kubectl create configmap eagle3-retrain-rayjob --from-file=rayjob.yaml=infra/rayjob-retrain.yaml \
#     --from-file=submit.sh=infra/retrain-submit.sh
# Never two retrainings at once: `concurrencyPolicy: Forbid` only sees a CronJob's own pods, so the pod
# (1) exits without creating anything while a RayJob labelled $SELECTOR is unfinished (a manual run, or one that
# outlived an earlier pod), and (2) otherwise creates one and waits until it finishes, failing when it fails.
# With DRIFT_ALERT set (the drift CronJob), it first reads the alert the Serve replicas record in that ConfigMap
# (data.alert_at, seconds since the epoch; the replicas may write that ConfigMap and nothing else) and goes on only
# when the alert is newer than the last retraining it started on drift (data.handled_at of $DRIFT_HANDLED, which
# only this script's service account writes) and that retraining started at least $DRIFT_MIN_INTERVAL_S ago. A value
# that is not a plain number, or lies in the future, is no alert. tests/test_infra.py runs it against a fake kubectl.
set -uo pipefail
if [ -n "${DRIFT_ALERT:-}" ]; then
  alert=$(kubectl get configmap "$DRIFT_ALERT" -o jsonpath='{.data.alert_at}') || exit 1
  handled=$(kubectl get configmap "$DRIFT_HANDLED" -o jsonpath='{.data.handled_at}') || exit 1
  now=$(date +%s)
  [[ "$alert" =~ ^[0-9]{1,12}$ ]] && (( 10#$alert <= now + 300 )) || alert=0
  [[ "$handled" =~ ^[0-9]{1,12}$ ]] || handled=0
  if (( 10#$alert <= 10#$handled )); then
    echo "no drift alert since the last retraining on drift"
    exit 0
  fi
  if (( now - 10#$handled < DRIFT_MIN_INTERVAL_S )); then
    echo "drift alert at $alert, but the last retraining on drift started at $handled, less than" \
         "${DRIFT_MIN_INTERVAL_S} s ago: not starting another yet"
    exit 0
  fi
fi
listing=$(kubectl get rayjobs -l "$SELECTOR" \
  -o jsonpath='{range .items[*]}{.metadata.name} {.status.jobDeploymentStatus}{"\n"}{end}') || exit 1
active=""
while read -r name state; do
  [ -z "$name" ] && continue
  case "$state" in Complete|Failed|ValidationFailed) ;; *) active="$active $name($state)" ;; esac
done <<< "$listing"
if [ -n "$active" ]; then
  echo "a retraining RayJob is still running:$active; not starting another"
  exit 0
fi
if [ -n "${DRIFT_ALERT:-}" ]; then
  kubectl patch configmap "$DRIFT_HANDLED" --type merge -p "{\"data\":{\"handled_at\":\"$now\"}}" || exit 1
  echo "retraining on the drift alert at $alert"
fi
job=$(kubectl create -f /rayjob/rayjob.yaml -o name) || exit 1
echo "created $job; waiting for it to finish"
while true; do
  state=$(kubectl get "$job" -o jsonpath='{.status.jobDeploymentStatus}/{.status.jobStatus}') || state=unknown
  case "$state" in
    Complete/SUCCEEDED) echo "$job succeeded"; exit 0 ;;
    Complete/*|Failed/*|ValidationFailed/*) echo "$job ended: $state"; exit 1 ;;
  esac
  sleep "$POLL_SECONDS"
done
