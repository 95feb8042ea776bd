#!/usr/bin/env bash
# etcd for the live suite's fleets on etcd discovery: Debian's etcd-server package (3.4),
# downloaded and unpacked into DIR, not installed (no root needed, nothing of the system
# touched). Returns at once when DIR's etcd already runs. `make test-dynamo` runs it with the
# cache directory outside the checkout and gives its binary to the tests as ETCD_BIN.
# Usage: install_etcd.sh [DIR]   (default: ${XDG_CACHE_HOME:-$HOME/.cache}/seqstate/etcd-3.4)
# The repository's own installer, tests/tools/install_etcd.sh, is used instead where it exists.
set -euo pipefail
dir=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/seqstate/etcd-3.4}
shared="$(dirname "$0")/../tools/install_etcd.sh"
[ -f "$shared" ] && exec bash "$shared" "$dir"
"$dir/usr/bin/etcd" --version >/dev/null 2>&1 && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
# apt's package lists may be empty on a fresh machine: refresh them once, if allowed to.
if ! apt-get download -qq etcd-server 2>/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    apt-get download -qq etcd-server
  else
    echo "install_etcd.sh: apt-get download etcd-server failed (run apt-get update as root)" >&2
    exit 1
  fi
fi
mkdir -p "$dir"
dpkg-deb -x etcd-server_*.deb "$dir"
"$dir/usr/bin/etcd" --version | head -1
