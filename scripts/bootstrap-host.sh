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
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
# The container tiers boot systemd in every container, about 4 inotify instances each:
# the kernel's default fs.inotify.max_user_instances (128) holds about 30 containers
# (bench/site_scale.py runs 37; the fleet-up playbook refuses past the limit).
INOTIFY=1024
if [ "$(cat /proc/sys/fs/inotify/max_user_instances)" -lt "$INOTIFY" ]; then
  echo "bootstrap: fs.inotify.max_user_instances=$INOTIFY (/etc/sysctl.d/60-shardfleet.conf)"
  echo "fs.inotify.max_user_instances = $INOTIFY" | $SUDO tee /etc/sysctl.d/60-shardfleet.conf >/dev/null \
    && $SUDO sysctl -q -w "fs.inotify.max_user_instances=$INOTIFY" \
    || echo "bootstrap: could not raise fs.inotify.max_user_instances; about 30 containers fit" >&2
fi
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
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
