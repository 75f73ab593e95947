#!/usr/bin/env bash
# make test's tiers in two lanes side by side (Makefile: TEST_LANE_A, TEST_LANE_B). Each
# lane runs its tiers one after another and stops at its first failure; every line it
# prints is prefixed with its lane ([a] or [b]). The exit status is non-zero when either
# lane failed, and the last lines say which tiers passed, failed or did not run.
#   scripts/test-lanes.sh "lint unit integration" "e2e"
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

start=$(date +%s)
( lane "$1" 2>&1 | sed -u 's/^/[a] /'; exit "${PIPESTATUS[0]}" ) &
a=$!
( lane "$2" 2>&1 | sed -u 's/^/[b] /'; exit "${PIPESTATUS[0]}" ) &
b=$!
wait "$a"; ra=$?
wait "$b"; rb=$?
echo "=== lanes done in $(( $(date +%s) - start ))s: a ($1) rc=$ra, b ($2) rc=$rb"
[ "$ra" -eq 0 ] && [ "$rb" -eq 0 ]
