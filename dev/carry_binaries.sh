#!/usr/bin/env bash
# Binaries built here, packed to be carried to a GPU host of the same OS instead of building
# there: build-dist/bin (TARGETS, stripped) and build-dist/lib (the libraries they load from
# outside the CUDA toolkit and libc). On the host: LD_LIBRARY_PATH=$PWD/build-dist/lib, then
# BIN=build-dist/bin for the scripts that take it (muon_share.sh, muon_sweep.sh) or
# tools/twin_compare.py --train build-dist/bin/train. kiln_gpu_tests (TARGETS) runs train and
# prepare_data from the bin directory it was built for, $BUILD/bin, and reads configs from this
# source root: where the host's copy is at the same path, `ln -sfn build-dist build` there.
#   bash dev/carry_binaries.sh                    # from the source root, after `make build`
# Env: BUILD (build), TARGETS ("train bench prepare_data").
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
TARGETS=${TARGETS:-train bench prepare_data}
cmake --build "$BUILD" -j "$(nproc)" --target $TARGETS > /dev/null
rm -rf build-dist
mkdir -p build-dist/bin build-dist/lib
for t in $TARGETS; do strip -o "build-dist/bin/$t" "$BUILD/bin/$t"; done
for t in $TARGETS; do ldd "$BUILD/bin/$t"; done | awk '/=>/ {print $3}' | sort -u |
  grep -Ev '/cuda|lib(c|m|dl|rt|pthread|gcc_s|stdc\+\+)\.so' | xargs -r -I{} cp -L {} build-dist/lib/
git rev-parse --short HEAD > .commit
echo "build-dist: $(du -sh build-dist | cut -f1), $(ls build-dist/lib | wc -l) libraries; carry" \
  "[\"build-dist\", \".commit\"]"
