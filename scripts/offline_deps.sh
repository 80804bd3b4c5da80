#!/usr/bin/env bash
# Packs what the build needs into .deps/offline/ for a GPU host with no package registry:
# the Debian -dev packages (and their runtime libraries) extracted into .deps/offline/root, and
# the cuDNN frontend headers. Copy (or `carry`) .deps/ there and build with
#   make build KILN_DEPS=.deps/offline/root
# The build links with an RPATH into that folder, so the libraries resolve at run time too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh

out=.deps/offline
rm -rf "$out/debs" "$out/root"
mkdir -p "$out/debs" "$out/root"
# -dev packages and the shared libraries they pull in that a CUDA base image lacks.
pkgs=(libyaml-cpp-dev libyaml-cpp0.7 libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
      libgtest-dev libgmock-dev googletest libgloo-dev libgloo0 libhiredis0.14 libhiredis-dev
      libibverbs1 libibverbs-dev libnl-3-200 libnl-route-3-200)
(cd "$out/debs" && apt-get download "${pkgs[@]}")
for f in "$out"/debs/*.deb; do dpkg -x "$f" "$out/root"; done
# Debian's gloo/yaml/spdlog CMake configs reference absolute /usr paths; point them at the root.
grep -rl '/usr/' "$out/root/usr/lib/x86_64-linux-gnu/cmake" "$out/root/usr/share/cmake" 2>/dev/null |
  xargs -r sed -i "s#\"/usr/#\"\${CMAKE_CURRENT_LIST_DIR}/../../../../usr/#g" || true
echo "offline_deps: $(du -sh "$out" | cut -f1) in $out (cuDNN frontend in .deps/cudnn-frontend)"
