#!/usr/bin/env bash
# Prints a colon-separated list of the directories holding the CUDA libraries that the GPU
# machine has as Python wheels (nvidia-cublas, nvidia-nccl-cu13, nvidia-cufile), for
# LD_LIBRARY_PATH. Empty when none is found (e.g. on this machine, where /usr/local/cuda has them).
#
#   export LD_LIBRARY_PATH="$(bash scripts/device/cuda_wheel_libs.sh):$LD_LIBRARY_PATH"
set -euo pipefail
python3 - <<'PY' 2>/dev/null || true
import glob, os, site
roots = set(site.getsitepackages() + [site.getusersitepackages()])
dirs = set()
for root in roots:
    for pattern in ("libcublas*.so*", "libnccl*.so*", "libcufile*.so*"):
        for path in glob.glob(os.path.join(root, "nvidia", "**", pattern), recursive=True):
            dirs.add(os.path.dirname(path))
print(":".join(sorted(dirs)))
PY
