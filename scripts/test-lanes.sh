#!/usr/bin/env bash
# Make targets in lanes side by side (the Makefile's `make test` and `make molecule`). Each
# argument is one lane: its targets, run one after another, stopping at the lane's first
# failure. Every line a lane prints is prefixed with its letter ([a], [b], ...). The exit
# status is non-zero when any lane failed; the last lines name each lane's result.
#   scripts/test-lanes.sh "lint unit integration" "e2e" "aws-test molecule"
set -uo pipefail

lane() {
  local t s
  for t in $1; do
    echo "=== tier: $t"
    s=$(date +%s)
    if ! make --no-print-directory "$t"; then
      echo "=== tier $t FAILED after $(( $(date +%s) - s ))s"
      return 1
    fi
    echo "=== tier $t passed in $(( $(date +%s) - s ))s"
  done
}

letters=(a b c d e f g h)
[ "$#" -ge 1 ] && [ "$#" -le "${#letters[@]}" ] || { echo "usage: $0 LANE..." >&2; exit 2; }
start=$(date +%s)
pids=()
for i in $(seq 0 $(( $# - 1 ))); do
  targets=${*:$(( i + 1 )):1}
  ( lane "$targets" 2>&1 | sed -u "s/^/[${letters[$i]}] /"; exit "${PIPESTATUS[0]}" ) &
  pids+=("$!")
done
rc=0
summary=()
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; r=$?
  [ "$r" -eq 0 ] || rc=1
  summary+=("${letters[$i]} (${*:$(( i + 1 )):1}) rc=$r")
done
printf -v joined '%s; ' "${summary[@]}"
echo "=== lanes done in $(( $(date +%s) - start ))s: ${joined%; }"
exit "$rc"
