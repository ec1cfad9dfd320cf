#!/usr/bin/env bash
# helm lint --strict on helm/nestquant with its default values and the 2-GPU values file.
# Usage: check_helm_lint.sh SOURCE_DIR
set -euo pipefail
NQ_ROOT=${1:?usage: check_helm_lint.sh SOURCE_DIR}
source "$(dirname "$0")/lib.sh"
need_node_modules
chart=$NQ_ROOT/helm/nestquant
"$NQ_DEPLOY_TOOLS/helm" version --short
"$NQ_DEPLOY_TOOLS/helm" lint --strict "$chart"
"$NQ_DEPLOY_TOOLS/helm" lint --strict "$chart" --values "$chart/ci/values-2gpu.yaml"
