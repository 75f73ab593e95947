#!/usr/bin/env bash
# Install the Debian packages shardfleet's tests need on this machine, idempotently.
# Fast when everything is there: it only asks dpkg. Needs root (or sudo) otherwise.
set -euo pipefail
PKGS=(
  mariadb-server mariadb-client mariadb-backup   # integration tier: real MariaDB host processes (and physical copies)
  zookeeper                       # integration tier: a standalone ZooKeeper (no daemon)
  redis-server memcached          # cache tests
  podman runc debootstrap uidmap slirp4netns fuse-overlayfs  # container tiers
  prometheus                      # lint tier: promtool checks and tests the monitoring role's rules
  python3-venv
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
echo "bootstrap: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d keeps the packages' own daemons from starting on the host: the
# tests start their own servers on free ports.
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod +x /usr/sbin/policy-rc.d
  trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
fi
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
