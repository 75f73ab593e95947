#!/usr/bin/env bash
# Time a fresh `site.yml` and its idempotent rerun on containers of the bench's
# own (sfbench-*, network shardfleet-bench on 10.242.2.0/24), so a developer's
# `make fleet` is left alone. Not a test: it prints the times and the rerun's
# changed count (and the tasks that changed), then removes its containers
# (KEEP=1 keeps them). The playbook logs stay in .cache/bench/.
#   bench/site_time.sh            # needs the image (make image) and the venv
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" ANSIBLE_CONFIG="$PWD/ansible.cfg" ANSIBLE_NOCOLOR=1

work="$(mktemp -d /tmp/shardfleet-bench.XXXXXX)"
logs="$PWD/.cache/bench"; mkdir -p "$logs"
cp -r inventories/local "$work/inventory"
rm -f "$work/inventory/added-pairs.yml"  # pairs a developer added are not the bench's
sed -e 's/ sf-/ sfbench-/g' -e 's/10\.242\.0\./10.242.2./g' inventories/local/hosts.yml >"$work/inventory/hosts.yml"
cat >"$work/vars.yml" <<'VARS'
shardfleet_network: shardfleet-bench
shardfleet_network_subnet: 10.242.2.0/24
shardfleet_fleet_label: bench
VARS
play() { ansible-playbook -i "$work/inventory" -e "@$work/vars.yml" "playbooks/$1" >"$work/$1.$2.log" 2>&1; }
cleanup() {
  [ "${KEEP:-0}" = 1 ] || play fleet-down.yml final || true
  cp "$work"/*.log "$logs/" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

play fleet-down.yml stale                  # fresh containers, nothing from an earlier run
t0=$(date +%s.%N); play fleet-up.yml up;   t1=$(date +%s.%N)
play site.yml fresh || { tail -n 40 "$work/site.yml.fresh.log"; exit 1; }; t2=$(date +%s.%N)
play site.yml rerun || { tail -n 40 "$work/site.yml.rerun.log"; exit 1; }; t3=$(date +%s.%N)

changed=$(awk '/^[^ ]+ +: ok=/ { for (i = 1; i <= NF; i++) if ($i ~ /^changed=/) { split($i, kv, "="); n += kv[2] } } END { print n + 0 }' "$work/site.yml.rerun.log")
hosts=$(grep -cE '^[^ ]+ +: ok=' "$work/site.yml.rerun.log")
awk -v up="$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')" \
    -v fresh="$(awk -v a="$t1" -v b="$t2" 'BEGIN{print b-a}')" \
    -v rerun="$(awk -v a="$t2" -v b="$t3" 'BEGIN{print b-a}')" \
    -v changed="$changed" -v hosts="$hosts" 'BEGIN {
  printf "fleet-up (%d containers)  %6.1f s\n", hosts, up
  printf "site.yml fresh            %6.1f s\n", fresh
  printf "site.yml rerun            %6.1f s   (changed=%d over %d hosts)\n", rerun, changed, hosts
  printf "rerun / fresh             %6.2f\n", rerun / fresh
}'
if [ "$changed" != 0 ]; then
  echo "tasks that changed on the rerun:"
  awk '/^TASK \[/ { task = $0 } /^changed: / { print "  " task " -> " $2 }' "$work/site.yml.rerun.log" | sed 's/ \**//' | sort -u
fi
