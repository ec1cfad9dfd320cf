# Sourced on the device by the scripts that run a .devspec bundle (binaries in bin/, the shared
# libraries they need in lib/, xz-compressed; built here as each script's header says):
#   unpack_devspec_bundle DIR    # extracts it into DIR, puts DIR/lib and the CUDA wheels' libraries
#                                # on LD_LIBRARY_PATH, sets B=DIR/bin; non-zero if it cannot
unpack_devspec_bundle() {
  local dir="$1"
  mkdir -p "$dir" && xz -dc .devspec/bundle.tar.xz | tar -C "$dir" -xf - || return 1
  LD_LIBRARY_PATH="$dir/lib:$(bash scripts/device/cuda_wheel_libs.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
  B="$dir/bin"
}
