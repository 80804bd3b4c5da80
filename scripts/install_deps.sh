#!/usr/bin/env bash
# Installs what kiln builds against: Debian -dev packages (yaml-cpp, spdlog + fmt, GoogleTest,
# Gloo, OpenMP, nlohmann-json, prometheus-cpp for train.metrics_port), Open MPI's mpirun (CI
# launches kiln under it), Prometheus itself (a test scrapes a run with it), matplotlib for
# tools/plot.py, Hugging Face's tokenizers for prepare_data --tokenizer FILE.json, TensorBoard
# (a test reads train.tensorboard's event files with its reader),
# and, where the CUDA toolkit is present, the cuDNN frontend headers (from PyPI's
# nvidia-cudnn-frontend wheel) and CUTLASS's headers (from PyPI's nvidia-cutlass wheel: the
# MoE experts' grouped GEMMs), unpacked into .deps/. Idempotent; runs as root or with sudo.
set -euo pipefail
cd "$(dirname "$0")/.."

CUDNN_FRONTEND_VERSION=1.32.0
CUTLASS_VERSION=4.2.0.0
packages=(build-essential cmake pkg-config libyaml-cpp-dev libspdlog-dev libfmt-dev libgtest-dev
          libgmock-dev libgloo-dev libomp-dev nlohmann-json3-dev unzip python3-pip openmpi-bin
          prometheus-cpp-dev prometheus)

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}"
else
  echo "install_deps: Debian packages present"
fi

# tools/plot.py draws with matplotlib, for the python3 on PATH (the one the tests run). PyPI
# first; Debian's package where pip may not install (an externally managed system Python).
if ! python3 -c "import matplotlib" >/dev/null 2>&1; then
  echo "install_deps: installing matplotlib"
  python3 -m pip install -q matplotlib ||
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
      python3-matplotlib
fi

# prepare_data --tokenizer FILE.json tokenizes with Hugging Face's tokenizers (its Python
# package) for the same python3. Debian 12 packages no tokenizers: where the system Python is
# externally managed, it goes to the user's site-packages, beside (not over) Debian's.
if ! python3 -c "import tokenizers" >/dev/null 2>&1; then
  echo "install_deps: installing tokenizers"
  python3 -m pip install -q tokenizers ||
    python3 -m pip install -q --user --break-system-packages tokenizers
fi

# tests/tensorboard_test.cpp reads event files with TensorBoard's own reader (PyPI's tensorboard;
# Debian 12 packages none), for the same python3.
if ! python3 -c "import tensorboard" >/dev/null 2>&1; then
  echo "install_deps: installing tensorboard"
  python3 -m pip install -q tensorboard ||
    python3 -m pip install -q --user --break-system-packages tensorboard
fi

# The cuDNN frontend is header-only C++; only the CUDA build needs it (KILN_CUDA=off: a CPU-only
# build, `make ... CUDA=off`, fetches it no more than a machine without nvcc does).
if [ "${KILN_CUDA:-on}" != off ] &&
   { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  dest=.deps/cudnn-frontend
  if [ ! -f "$dest/include/cudnn_frontend.h" ]; then
    echo "install_deps: fetching cuDNN frontend headers $CUDNN_FRONTEND_VERSION"
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" \
      "nvidia-cudnn-frontend==$CUDNN_FRONTEND_VERSION"
    mkdir -p "$dest"
    unzip -q -o "$tmp"/nvidia_cudnn_frontend-*.whl 'include/*' -d "$dest"
    rm -rf "$tmp"
  fi
  echo "install_deps: cuDNN frontend headers in $dest/include"
  # CUTLASS is header-only C++ too; its wheel carries the headers under cutlass_library/source.
  dest=.deps/cutlass
  if [ ! -f "$dest/include/cutlass/cutlass.h" ]; then
    echo "install_deps: fetching CUTLASS headers $CUTLASS_VERSION"
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" \
      "nvidia-cutlass==$CUTLASS_VERSION"
    unzip -q -o "$tmp"/nvidia_cutlass-*.whl 'cutlass_library/source/include/*' -d "$tmp"
    rm -rf "$dest"
    mkdir -p "$dest"
    mv "$tmp/cutlass_library/source/include" "$dest/include"
    rm -rf "$tmp"
  fi
  echo "install_deps: CUTLASS headers in $dest/include"
fi
