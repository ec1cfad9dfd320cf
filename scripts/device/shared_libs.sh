# Sourced by the device packaging scripts: copies the shared libraries binaries load (ldd) into
# a directory, except those the GPU machine provides itself: glibc, the C++ runtime, the CUDA
# driver, and cuBLAS and NCCL (their nvidia-cublas and nvidia-nccl wheels; scripts/device/
# cuda_wheel_libs.sh puts them on the path; libnccl.so.2 alone is 218 MB, past the bundle's room).
#
#   copy_shared_libs LIB_DIR BINARY...    # non-zero when ldd cannot resolve a library here

is_system_library() {
  case "$1" in
    linux-vdso.so* | ld-linux*.so* | libc.so* | libm.so* | libdl.so* | libpthread.so* | \
      librt.so* | libstdc++.so* | libgcc_s.so* | libcuda.so* | libnvidia-*.so* | libcublas*.so* | libnccl*.so*)
      return 0 ;;
  esac
  return 1
}

copy_shared_libs() {
  local lib_dir="$1" missing=0 bin name arrow path
  shift
  mkdir -p "$lib_dir"
  for bin in "$@"; do
    while read -r name arrow path _; do
      [[ "$arrow" == "=>" ]] || continue
      if [[ "$path" == "not" ]]; then
        echo "$(basename "$0"): $bin needs $name, which ldd cannot find here" >&2
        missing=1
        continue
      fi
      is_system_library "$name" || cp -L "$path" "$lib_dir/$name"
    done < <(ldd "$bin")
  done
  return "$missing"
}
