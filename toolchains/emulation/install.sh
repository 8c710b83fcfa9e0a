#!/usr/bin/env bash
# Installs what //tests/targets needs to run aarch64 modules on an x86-64 machine: qemu's user-mode emulator
# and the aarch64 C and C++ runtime libraries (Debian's cross packages, a sysroot in /usr/aarch64-linux-gnu;
# no multiarch set-up). The aarch64 IREE tools come from the pinned wheel (@dsa_runtime_aarch64, fetched by
# Bazel). Without these packages the emulation test skips, saying to run this script; .ci/run runs it.
set -euo pipefail
packages="qemu-user-static libc6-arm64-cross libstdc++6-arm64-cross libgcc-s1-arm64-cross"
missing=""
for p in $packages; do
    [ "$(dpkg-query -W -f '${Status}' "$p" 2>/dev/null || true)" = "install ok installed" ] || missing="$missing $p"
done
if [ -z "$missing" ]; then
    echo "emulation: installed already: $packages"
    exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "emulation: installing$missing with apt-get" >&2
$sudo apt-get update >&2
# shellcheck disable=SC2086 # one word per package
$sudo apt-get install -y $missing >&2
echo "emulation: installed $(dpkg-query -W $packages | tr '\t\n' '  ')"
