#!/usr/bin/env bash
# A Docker engine for `make image` and `make deploy-check` on a Debian machine without systemd (these
# machines, CI): installs Debian's docker.io and debootstrap when missing (as root), then starts
# dockerd in the background unless one already answers. Its log: $DOCKERD_LOG. Safe to run again.
set -euo pipefail
DOCKERD_LOG="${DOCKERD_LOG:-/tmp/batch-assets-dockerd.log}"

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "docker_engine: ${missing[*]} missing; install them (apt-get install ${missing[*]}) or run as root" >&2
    exit 1
  fi
  echo "docker_engine: installing ${missing[*]} from Debian's packages"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if docker info >/dev/null 2>&1; then
  exit 0
fi
echo "docker_engine: starting dockerd (log: $DOCKERD_LOG)"
nohup dockerd >"$DOCKERD_LOG" 2>&1 &
for _ in $(seq 60); do
  docker info >/dev/null 2>&1 && exit 0
  sleep 1
done
echo "docker_engine: dockerd did not answer within 60 s; the end of its log:" >&2
tail -n 20 "$DOCKERD_LOG" >&2
exit 1
