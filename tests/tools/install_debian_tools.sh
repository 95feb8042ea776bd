#!/usr/bin/env bash
# The Debian tools some tests drive, installed when missing: chromium (the report's and /ui's
# pages, opened headless) and kubectl (`kubectl kustomize` renders deploy/k8s). Installing needs
# root; without it, each missing tool is named with the command that installs it, and the
# tests that need it fail saying the same (never skip). Present ones cost nothing.
set -uo pipefail
missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v kubectl >/dev/null || missing+=(kubernetes-client)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
else
    echo "make test: missing ${missing[*]}: apt-get install -y ${missing[*]} (as root)" >&2
fi
exit 0
