#!/usr/bin/env bash
# helm template with the default values and with ci/values-2gpu.yaml; every object checked
# by check_manifests.mjs (schemas and cross-references) and every service flag by
# check_flags.mjs; a bad value fails the render with a message (values.schema.json, or the
# templates' own checks).
# Usage: check_helm_template.sh SOURCE_DIR NQ_ROUTER NQ_STREAMER NQ_WORKER NQ
set -euo pipefail
NQ_ROOT=${1:?usage: check_helm_template.sh SOURCE_DIR NQ_ROUTER NQ_STREAMER NQ_WORKER NQ}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"
need node
need_node_modules
helm=$NQ_DEPLOY_TOOLS/helm
chart=$NQ_ROOT/helm/nestquant
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$helm" template nq "$chart" --namespace serving >"$work/default.yaml"
node "$here/check_manifests.mjs" "$NQ_ROOT" "$work/default.yaml" 1 \
  ServiceAccount=1 Service=2 Deployment=2 ConfigMap=1 NetworkPolicy=1
"$helm" template nq "$chart" --namespace serving --values "$chart/ci/values-2gpu.yaml" >"$work/2gpu.yaml"
node "$here/check_manifests.mjs" "$NQ_ROOT" "$work/2gpu.yaml" 2 \
  ServiceAccount=1 Service=2 Deployment=2 ConfigMap=1 NetworkPolicy=1 ServiceMonitor=1 PrometheusRule=1
# The CPU backend renders without GPU requests (checked by check_manifests.mjs's GPU rule
# only for cuda workers): it must still render and validate.
"$helm" template nq "$chart" --set worker.backend=cpu --set grafanaDashboard.enabled=false \
  --set networkPolicy.enabled=false --set serviceAccount.create=false >"$work/cpu.yaml"
node "$here/check_manifests.mjs" "$NQ_ROOT" "$work/cpu.yaml" 1 Service=2 Deployment=2
if grep -q 'nvidia.com/gpu:' "$work/cpu.yaml"; then
  echo "worker.backend=cpu still requests GPUs" >&2
  exit 1
fi
# Mutual TLS between router and workers (values internalTls): the secret is mounted and named in
# the flags of the router and of every worker; without it the workers say they run plain text.
"$helm" template nq "$chart" --namespace serving --values "$chart/ci/values-2gpu.yaml" \
  --set internalTls.secretName=nq-internal-tls >"$work/tls.yaml"
node "$here/check_manifests.mjs" "$NQ_ROOT" "$work/tls.yaml" 2 \
  ServiceAccount=1 Service=2 Deployment=2 ConfigMap=1 NetworkPolicy=1 ServiceMonitor=1 PrometheusRule=1
[[ $(grep -c -- '--tls_cert=/etc/nestquant/tls/tls.crt' "$work/tls.yaml") == 3 ]] || {
  echo "internalTls.secretName: expected the TLS flags on the router and both workers" >&2
  exit 1
}
[[ $(grep -c 'secretName: nq-internal-tls' "$work/tls.yaml") == 2 ]] || {
  echo "internalTls.secretName: expected the secret as a volume of the router and the engine pods" >&2
  exit 1
}
if grep -q -- '--allow_plaintext_internal' "$work/tls.yaml"; then
  echo "internalTls.secretName set, yet a worker still allows plain text" >&2
  exit 1
fi
[[ $(grep -c -- '--allow_plaintext_internal' "$work/2gpu.yaml") == 2 ]] || {
  echo "without internalTls the workers must say --allow_plaintext_internal" >&2
  exit 1
}
# A group over two nodes (engine.nodes): a StatefulSet of one pod per node with 4 ranks each, a
# headless Service naming pod 0 for the router, the other node's workers and its streamer
# (check_manifests.mjs checks the flags that tie them together), engine-to-engine traffic admitted.
"$helm" template nq "$chart" --namespace serving --values "$chart/ci/values-2gpu.yaml" \
  --set engine.nodes=2 --set tensorParallelSize=8 --set internalTls.secretName=nq-internal-tls >"$work/2node.yaml"
node "$here/check_manifests.mjs" "$NQ_ROOT" "$work/2node.yaml" 8 \
  ServiceAccount=1 Service=3 Deployment=1 StatefulSet=1 ConfigMap=1 NetworkPolicy=1 ServiceMonitor=1 PrometheusRule=1
# The streamer listens beyond loopback there, so it takes the TLS flags too (router, 4 workers, streamer).
[[ $(grep -c -- '--tls_cert=/etc/nestquant/tls/tls.crt' "$work/2node.yaml") == 6 ]] || {
  echo "engine.nodes=2: expected the TLS flags on the router, the 4 workers of a pod and its streamer" >&2
  exit 1
}
# Without the TLS secret every service runs its links in plain text, each saying so once.
"$helm" template nq "$chart" --namespace serving --values "$chart/ci/values-2gpu.yaml" \
  --set engine.nodes=2 --set tensorParallelSize=8 >"$work/2node-plain.yaml"
node "$here/check_manifests.mjs" "$NQ_ROOT" "$work/2node-plain.yaml" 8 \
  ServiceAccount=1 Service=3 Deployment=1 StatefulSet=1 ConfigMap=1 NetworkPolicy=1 ServiceMonitor=1 PrometheusRule=1
node "$here/check_flags.mjs" "$2" "$3" "$4" "$work/default.yaml" "$work/2gpu.yaml" "$work/tls.yaml" "$work/2node.yaml" \
  "$work/2node-plain.yaml"

# Bad values are refused at render time, naming the value.
expect_refused() {
  local want=$1
  shift
  local out
  if out=$("$helm" template nq "$chart" "$@" 2>&1); then
    echo "helm template $* rendered; expected a refusal mentioning '$want'" >&2
    exit 1
  fi
  grep -qF -- "$want" <<<"$out" || { echo "helm template $*: '$out' lacks '$want'" >&2; exit 1; }
}
expect_refused "tensorParallelSize: Must be greater than or equal to 1" --set tensorParallelSize=0
expect_refused 'worker.backend must be one of the following: "cuda", "cpu"' --set worker.backend=rocm
expect_refused "Additional property slotsPerLayr is not allowed" --set worker.slotsPerLayr=8
expect_refused "worker.slotsPerLayer: Invalid type. Expected: integer" --set-string worker.slotsPerLayer=8
expect_refused "tensorParallelSize 6 is not a multiple of engine.nodes 4" --set engine.nodes=4 --set tensorParallelSize=6
expect_refused "engine.nodes above 1 needs worker.backend cuda" --set engine.nodes=2 --set tensorParallelSize=2 \
  --set worker.backend=cpu
expect_refused "more than 16 ranks a node" --set tensorParallelSize=32
expect_refused "set model.existingClaim or model.hostPath" --set model.hostPath=
expect_refused "set records.existingClaim or records.hostPath" --set records.hostPath=
echo "helm template: all renders valid"
