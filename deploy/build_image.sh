#!/usr/bin/env bash
# `make image`: deploy/Dockerfile built on this machine, where no registry answers.
#   ENGINE=cpu (default here) or gpu; TAG (default batch-assets:$ENGINE);
#   BASE: the image to build on; the default, batch-assets-base:bookworm, is made here once
#   (debootstrap --variant=minbase bookworm, then `docker import`) and kept by the engine.
#   BUILD_SOURCES_PORT: the loopback port of the sources below (default 38517);
#   CA_BUNDLE: the certificates the build trusts (default: this machine's bundle, which holds the CA of
#   an HTTPS-intercepting proxy where there is one).
# The bundle and the wheel folders and indexes of this machine's pip configuration (where a package of
# the lock may be only there, e.g. torch 2.13.0+cpu) are served on loopback for the build's length;
# the build runs on the host's network to reach them. They enter no layer (deploy/install_locked.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE="${ENGINE:-cpu}"
TAG="${TAG:-batch-assets:$ENGINE}"
BASE="${BASE:-batch-assets-base:bookworm}"
PYTHON="${PYTHON:-python3}"
CA_BUNDLE="${CA_BUNDLE:-$("$PYTHON" -c 'import ssl; print(ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt")')}"
started=$SECONDS

bash scripts/docker_engine.sh
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  if [ "$BASE" != batch-assets-base:bookworm ]; then
    docker pull "$BASE"
  else
    rootfs="$(mktemp -d /var/tmp/batch-assets-base.XXXXXX)"
    echo "image: making $BASE with debootstrap (once; kept by the Docker engine)"
    debootstrap --variant=minbase bookworm "$rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$rootfs.log"
    tar -C "$rootfs" -c . | docker import - "$BASE" >/dev/null
    rm -rf "$rootfs" "$rootfs.log"
  fi
fi

served="$(mktemp -d)"
cleanup() {
  [ -n "${server:-}" ] && kill "$server" 2>/dev/null || true
  rm -rf "$served"
}
trap cleanup EXIT
# A fixed port: the URL is a build argument, and a new one each time would make every build install
# the lock again instead of reusing its layer.
port="${BUILD_SOURCES_PORT:-38517}"
url="http://127.0.0.1:$port"
cp "$CA_BUNDLE" "$served/ca.pem"
# The uv options setup.sh uses on this machine (scripts/uv_sources.sh), each local folder served.
. scripts/uv_sources.sh
uv_sources "$ENGINE" "$PYTHON"
n=0
for option in "${UV_SOURCES[@]}"; do
  local_path="${option#file://}"
  if [ "${local_path:0:1}" = / ] && [ -d "$local_path" ]; then
    # An index links its files relative to itself (../../files/...): its parent folder is served.
    parent="$(dirname "$local_path")"
    ln -s "$parent" "$served/$n"
    option="$url/$n/$(basename "$local_path")/"
    n=$((n + 1))
  fi
  echo "$option" >>"$served/uv-options"
done
"$PYTHON" -m http.server --bind 127.0.0.1 --directory "$served" "$port" >/dev/null 2>&1 &
server=$!

docker build --network host --force-rm -f deploy/Dockerfile -t "$TAG" \
  --build-arg "BASE=$BASE" --build-arg "ENGINE=$ENGINE" --build-arg "BUILD_SOURCES=$url" .
echo "image: $TAG built in $((SECONDS - started)) s ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.1f GB", $1 / 1e9}'))"
