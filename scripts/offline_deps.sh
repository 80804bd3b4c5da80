#!/usr/bin/env bash
# Packs what the build needs into .deps/ for a GPU host with no package registry:
#   .deps/offline/root        Debian 12 -dev packages and their runtime libraries, dpkg -x'd
#   .deps/cudnn-frontend      the cuDNN frontend headers (scripts/install_deps.sh)
#   .deps/cutlass             CUTLASS's headers (scripts/install_deps.sh)
# The GPU host brings its own compiler, CMake, CUDA, cuDNN and NCCL. Copy (or `carry`) .deps/
# there and build with
#   cmake -S . -B build -DKILN_DEPS=.deps/offline/root
# CMake finds the packages' config files in the bundle, and links with an RPATH (not RUNPATH)
# into it, so the bundle's libraries resolve at run time, each other's dependencies included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh

out=.deps/offline
root="$out/root"
rm -rf "$out/debs" "$root"
mkdir -p "$out/debs" "$root"
# -dev packages and the shared libraries they pull in that a CUDA base image lacks.
pkgs=(libyaml-cpp-dev libyaml-cpp0.7 libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
      libgtest-dev libgmock-dev libgloo-dev libgloo0 libhiredis0.14 libhiredis-dev
      libibverbs1 libibverbs-dev libnl-3-200 libnl-route-3-200 nlohmann-json3-dev)
# apt's sandbox user must be able to write into the download folder.
chmod 777 "$out/debs"
(cd "$out/debs" && apt-get download -q "${pkgs[@]}")
for f in "$out"/debs/*.deb; do dpkg -x "$f" "$root"; done

# One library folder: Debian puts libnl in /lib and gloo in /usr/lib; the RPATH names
# usr/lib/x86_64-linux-gnu (and CMake adds gloo's folder itself), so gather them there.
lib="$root/usr/lib/x86_64-linux-gnu"
if [ -d "$root/lib/x86_64-linux-gnu" ]; then
  cp -a "$root"/lib/x86_64-linux-gnu/. "$lib"/
  rm -rf "$root/lib"
fi
for f in "$root"/usr/lib/libgloo.so*; do ln -sf "../$(basename "$f")" "$lib/$(basename "$f")"; done

# yaml-cpp, spdlog, fmt and GTest configs are relocatable as shipped (paths relative to the
# config file). Gloo's and Hiredis's name absolute /usr paths: rewrite them relative to each file.
for cfg in "$root"/usr/share/cmake/Gloo/*.cmake "$root"/usr/lib/x86_64-linux-gnu/cmake/Hiredis/*.cmake; do
  [ -f "$cfg" ] || continue
  up=$(realpath --relative-to="$(dirname "$cfg")" "$root")
  sed -i "s#\"/usr/#\"\${CMAKE_CURRENT_LIST_DIR}/$up/usr/#g" "$cfg"
done

# Not needed to build: docs and the googletest sources (libgtest-dev ships the built archives).
rm -rf "$root/usr/share/doc" "$root/usr/share/man" "$root/usr/src"

# Every shared library's dependencies must be in the bundle or in any glibc/libstdc++ system.
missing=0
for f in $(find "$lib" "$root/usr/lib" -maxdepth 1 -name '*.so.*' -type f); do
  for dep in $(objdump -p "$f" | awk '/NEEDED/{print $2}'); do
    case "$dep" in
      libc.so.*|libm.so.*|libstdc++.so.*|libgcc_s.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*) ;;
      *) [ -e "$lib/$dep" ] || { echo "offline_deps: $f needs $dep, not in the bundle"; missing=1; } ;;
    esac
  done
done
[ "$missing" = 0 ] || exit 1
echo "offline_deps: $(du -sh "$root" | cut -f1) in $root, cuDNN frontend $(du -sh .deps/cudnn-frontend | cut -f1), CUTLASS $(du -sh .deps/cutlass | cut -f1)"
