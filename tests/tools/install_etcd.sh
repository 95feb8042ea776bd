#!/usr/bin/env bash
# Makes an etcd binary available to the tests without a system install, and prints its path:
# Debian's etcd-server package (3.4), downloaded with apt and unpacked (dpkg-deb -x) into DIR,
# outside the checkout. Returns at once when DIR already holds a working etcd, or when one is
# installed system-wide (/usr/bin/etcd). `make test` runs it before pytest; the tests find the
# binary through ETCD_BIN, else DIR's default, else PATH (tests/support/etcd_server.py).
# Usage: install_etcd.sh [DIR]   (default: ${XDG_CACHE_HOME:-$HOME/.cache}/seqstate/etcd-3.4)
set -euo pipefail
dir=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/seqstate/etcd-3.4}
bin="$dir/usr/bin/etcd"
works() { [ -x "$1" ] && "$1" --version >/dev/null 2>&1; }
if works "$bin"; then echo "$bin"; exit 0; fi
if works /usr/bin/etcd; then echo /usr/bin/etcd; exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# A machine that never ran `apt-get update` has no package lists to download from.
if ! (cd "$tmp" && apt-get download -q etcd-server >/dev/null 2>&1); then
  apt-get update -q >/dev/null
  (cd "$tmp" && apt-get download -q etcd-server >/dev/null)
fi
mkdir -p "$dir"
dpkg-deb -x "$tmp"/etcd-server_*.deb "$dir"
works "$bin" || { echo "install_etcd.sh: $bin does not run" >&2; exit 1; }
echo "$bin"
