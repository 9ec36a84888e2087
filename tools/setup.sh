#!/usr/bin/env bash
# Set up libmoejit on Debian 12 / Ubuntu: install the build dependencies with apt-get, build
# Release in build/, then either prewarm the reference shapes (run) or run every test (test).
#
#   bash tools/setup.sh run    # deps + build + `moejit prewarm tools/shapes/reference.json --arch sm_90a`
#   bash tools/setup.sh test   # deps + build + `ctest --output-on-failure` (all labels)
#
# Settings (environment): MOEJIT_CACHE_DIR (where run prewarms to), CUDA_HOME (toolkit, default
# /usr/local/cuda), MOEJIT_BUILD_DIR (default build/), JOBS (parallel build jobs, default nproc),
# CTEST_JOBS (parallel tests, default 2).
set -euo pipefail

usage() {
  sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

die() {
  echo "setup.sh: $*" >&2
  exit 1
}

mode="${1:-}"
case "$mode" in
  run | test) ;;
  -h | --help | help)
    usage
    exit 0
    ;;
  *)
    usage >&2
    die "expected 'run' or 'test', got '${mode}'"
    ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${MOEJIT_BUILD_DIR:-$root/build}"
jobs="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
ctest_jobs="${CTEST_JOBS:-2}"

# apt-get runs through sudo when not root; sudo is needed only once a package is missing.
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi

step() {
  echo
  echo "==> $*"
}

install_deps() {
  local packages=(cmake ninja-build g++ nlohmann-json3-dev libspdlog-dev libfmt-dev catch2
                  libcli11-dev libxxhash-dev libdlpack-dev python3)
  local missing=()
  local p
  for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    step "dependencies: all installed (${packages[*]})"
    return
  fi
  command -v apt-get >/dev/null 2>&1 ||
    die "apt-get not found; install these packages with your package manager: ${missing[*]}"
  if [ "${#sudo_cmd[@]}" -gt 0 ] && ! command -v sudo >/dev/null 2>&1; then
    die "not root and sudo is not installed; install these packages as root: ${missing[*]}"
  fi
  step "installing with apt-get: ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y --no-install-recommends \
    "${missing[@]}"
}

find_cuda() {
  local candidates=()
  [ -n "${CUDA_HOME:-}" ] && candidates+=("$CUDA_HOME")
  candidates+=(/usr/local/cuda)
  local dir
  for dir in "${candidates[@]}"; do
    if [ -f "$dir/include/nvrtc.h" ] && [ -f "$dir/include/cuda.h" ] &&
      ls "$dir"/lib*/libnvrtc.so* >/dev/null 2>&1; then
      cuda_dir="$dir"
      step "CUDA toolkit: $cuda_dir ($("$cuda_dir/bin/nvcc" --version 2>/dev/null | tail -1 || echo "nvcc not found"))"
      return
    fi
  done
  cat >&2 <<MSG
setup.sh: no CUDA toolkit found (looked in: ${candidates[*]}; need include/nvrtc.h,
include/cuda.h and lib*/libnvrtc.so). libmoejit builds against the toolkit (12.4 or newer; 13.0
is tested) for NVRTC and the driver API's header. On Debian 12, from NVIDIA's repository:
  wget https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb
  ${sudo_cmd[*]} dpkg -i cuda-keyring_1.1-1_all.deb && ${sudo_cmd[*]} apt-get update
  ${sudo_cmd[*]} apt-get install -y cuda-toolkit-13-0
(on Ubuntu use the ubuntu2204 or ubuntu2404 repository), or set CUDA_HOME to a toolkit that is
already installed.
MSG
  exit 1
}

build() {
  # Why: `run` needs no tests (building Catch2 test binaries is most of the build time).
  local tests=OFF
  [ "$mode" = test ] && tests=ON
  step "configuring Release in $build_dir (tests $tests)"
  cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCUDAToolkit_ROOT="$cuda_dir" -DMOEJIT_BUILD_TESTS="$tests"
  step "building with $jobs jobs"
  cmake --build "$build_dir" -j "$jobs"
}

install_deps
find_cuda
build

case "$mode" in
  run)
    step "prewarming tools/shapes/reference.json for sm_90a into ${MOEJIT_CACHE_DIR:-the default cache}"
    "$build_dir/moejit" prewarm "$root/tools/shapes/reference.json" --arch sm_90a
    echo
    echo "Done. Inspect the cache with: $build_dir/moejit list   (or: moejit doctor)"
    ;;
  test)
    step "running every test (GPU tests show as skipped without a GPU)"
    ctest --test-dir "$build_dir" --output-on-failure -j "$ctest_jobs"
    ;;
esac
