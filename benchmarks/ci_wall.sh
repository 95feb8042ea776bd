#!/usr/bin/env bash
# Wall time of CI on a fresh clone: `benchmarks/ci_wall.sh REV [RUNS]`.
#
# CI runs `.ci/run` on a clean clone of main; this does the same for REV, RUNS times (3 by
# default), each in a new clone (a new .venv, the pip cache as the machine has it), and prints
# each run's seconds, exit code and pytest's summary lines, then the median. Compare two
# revisions by interleaving them, with nothing else running: the machine is the noise.
set -euo pipefail
rev=${1:?usage: benchmarks/ci_wall.sh REV [RUNS]}
runs=${2:-3}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
times=()
for i in $(seq "$runs"); do
  work=$(mktemp -d)
  git clone -q "$repo" "$work/clone"
  git -C "$work/clone" checkout -q "$rev"
  start=$(date +%s)
  rc=0
  (cd "$work/clone" && CI=true bash .ci/run) >"$work/log" 2>&1 || rc=$?
  seconds=$(($(date +%s) - start))
  times+=("$seconds")
  echo "run $i: ${seconds}s exit $rc"
  grep -E '^=+ .*(passed|failed)' "$work/log" | sed 's/^/  /' || true
  rm -rf "$work"
done
printf '%s\n' "${times[@]}" | sort -n | awk '{a[NR]=$1} END {print "median: " a[int((NR+1)/2)] "s of " NR " runs"}'
