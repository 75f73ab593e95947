#!/usr/bin/env bash
# Build the base image the local fleet's containers boot from (systemd inside),
# from Debian's own packages: debootstrap -> podman import -> apt-get install ->
# podman commit. No registry is needed. Idempotent: skipped when the image exists
# (FORCE=1 rebuilds it).
#
# The fleet's packages are baked in so that the roles' package tasks are no-ops
# in tests (a 2-core CI box cannot afford apt-get in every container); the roles
# still install them on hosts that lack them (EC2). Their services are disabled
# in the image: each role enables and starts only its own service, with its own
# configuration, so a redis container does not also run MariaDB and a JVM.
#
#   SHARDFLEET_IMAGE   image name (default localhost/shardfleet-base:bookworm)
#   DEBIAN_MIRROR      Debian mirror (default http://deb.debian.org/debian)
#   FORCE=1            rebuild even if the image exists
set -euo pipefail

IMAGE="${SHARDFLEET_IMAGE:-localhost/shardfleet-base:bookworm}"
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
STAGE="localhost/shardfleet-rootfs:${SUITE}-stage"
BUILDER="shardfleet-image-build-$$"

# Packages every fleet role may need (kept in step with the roles' package lists).
FLEET_PACKAGES=(
  mariadb-server mariadb-client mariadb-backup python3-pymysql   # roles/mysql
  zookeeper python3-kazoo                         # roles/zookeeper (native unit, no zookeeperd)
  redis-server                                    # roles/redis
  memcached                                       # roles/memcached
  python3-yaml                                    # roles/shards (the shardfleet library)
  python3-boto3 zstd                              # playbooks/backup.yml, restore.yml (S3)
  prometheus-node-exporter prometheus-mysqld-exporter prometheus-redis-exporter  # roles/monitoring
  prometheus prometheus-alertmanager                                           # (its server host)
)
# Services those packages enable; disabled in the image (the roles enable their own).
FLEET_SERVICES=(mariadb.service redis-server.service memcached.service
  prometheus.service prometheus-alertmanager.service prometheus-node-exporter.service
  prometheus-mysqld-exporter.service prometheus-redis-exporter.service)
# Timers that would wake up in every container on every boot.
MASKED_UNITS=(apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer
  man-db.timer dpkg-db-backup.timer systemd-tmpfiles-clean.timer)

# The image records the package list it was built with: a changed list rebuilds it.
PACKAGES_LABEL="$(printf '%s ' "${FLEET_PACKAGES[@]}" | sha256sum | cut -c1-16)"
if [ "${FORCE:-0}" != 1 ] && podman image exists "$IMAGE"; then
  have="$(podman image inspect --format '{{ index .Labels "org.shardfleet.packages" }}' "$IMAGE")"
  if [ "$have" = "$PACKAGES_LABEL" ]; then
    echo "build-image: $IMAGE exists, skipping (FORCE=1 rebuilds)"
    exit 0
  fi
  echo "build-image: $IMAGE was built with another package list; rebuilding"
fi
[ "$(id -u)" -eq 0 ] || { echo "build-image: needs root (debootstrap, rootful podman)" >&2; exit 1; }
for tool in debootstrap podman; do
  command -v "$tool" >/dev/null || { echo "build-image: $tool missing (make host-deps)" >&2; exit 1; }
done

WORK="$(mktemp -d /var/tmp/shardfleet-image.XXXXXX)"
cleanup() {
  podman rm -f "$BUILDER" >/dev/null 2>&1 || true
  podman rmi -f "$STAGE" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

start=$(date +%s)
echo "build-image: debootstrap $SUITE (minbase) into $WORK/rootfs"
debootstrap --variant=minbase \
  --include=python3,python3-apt,systemd,systemd-sysv,dbus,sudo,iproute2,procps,ca-certificates \
  "$SUITE" "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -n 30 "$WORK/debootstrap.log" >&2; exit 1; }
cat >"$WORK/rootfs/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
SOURCES
tar -C "$WORK/rootfs" -c . | podman import -q - "$STAGE" >/dev/null
rm -rf "$WORK/rootfs"

echo "build-image: installing ${FLEET_PACKAGES[*]}"
# policy-rc.d: package scripts must not start daemons inside the build container.
podman run --name "$BUILDER" --runtime=runc --network=host \
  --ulimit nofile=8192:8192 --ulimit nproc=8192:8192 \
  -e DEBIAN_FRONTEND=noninteractive "$STAGE" /bin/bash -euo pipefail -c "
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
    apt-get update -q
    apt-get install -y -q --no-install-recommends ${FLEET_PACKAGES[*]}
    systemctl disable ${FLEET_SERVICES[*]}
    systemctl mask ${MASKED_UNITS[*]}
    # A container's console is not a terminal: no getty on it.
    systemctl mask console-getty.service getty@tty1.service systemd-logind.service
    rm -f /usr/sbin/policy-rc.d
    apt-get clean; rm -rf /var/lib/apt/lists/*
    # mysql_install_db ran at package install: leave no server state from it
    # but the system tables the role expects; no pid/socket files.
    rm -f /run/mysqld/* || true
  " >"$WORK/install.log" 2>&1 || { tail -n 40 "$WORK/install.log" >&2; exit 1; }

podman commit -q \
  --change 'CMD ["/lib/systemd/systemd"]' \
  --change 'STOPSIGNAL SIGRTMIN+3' \
  --change 'LABEL org.shardfleet.image=base' \
  --change "LABEL org.shardfleet.packages=$PACKAGES_LABEL" \
  "$BUILDER" "$IMAGE" >/dev/null
echo "build-image: built $IMAGE in $(( $(date +%s) - start ))s ($(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%d MB", $1/1e6}'))"
