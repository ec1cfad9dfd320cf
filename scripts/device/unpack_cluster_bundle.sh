# Sourced by the device scripts that run over .gpu-cluster/bundle.tar.xz (package_cluster.sh):
# unpacks it into a new temporary directory $work, says what it carried, and puts the carried
# libraries, then the GPU machine's CUDA wheels (cuBLAS, NCCL), on LD_LIBRARY_PATH.
work="$(mktemp -d)"
tar -C "$work" -xJf .gpu-cluster/bundle.tar.xz || { echo "cannot unpack .gpu-cluster/bundle.tar.xz"; exit 1; }
echo "== carried: $(head -n 1 "$work/MANIFEST")"
export LD_LIBRARY_PATH="$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
wheel_libs="$(bash scripts/device/cuda_wheel_libs.sh)"
[[ -n "$wheel_libs" ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$wheel_libs"
