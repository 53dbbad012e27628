#!/usr/bin/env bash
# Build the services image from deploy/Dockerfile with buildah (no container daemon needed) and
# tag it gpusched:<version from pyproject.toml>. Used by `make image`; never by `make test`.
#
#   scripts/image.sh                                   # base python:3.11-slim (docker.io)
#   GPUSCHED_BASE_IMAGE=mirror.example/library/python:3.11-slim scripts/image.sh
#
# As root it installs Debian's buildah when it is missing (apt-get). It builds with vfs storage
# and chroot isolation (STORAGE_DRIVER / BUILDAH_ISOLATION override them), which work on a box
# without a container runtime; the image lands in buildah's local storage. The base image is
# pulled (or, when the pull fails, taken from that storage if it is there already).
# When it cannot build (not root, no buildah and no way to install it, the base image not
# pullable) it prints one line starting with "image: skipped:" saying what is missing and what
# to do, and exits 0. A build that starts and fails exits non-zero. Logs: .cache/image/.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
LOGDIR="$ROOT/.cache/image"
BASE="${GPUSCHED_BASE_IMAGE:-python:3.11-slim}"
export STORAGE_DRIVER="${STORAGE_DRIVER:-vfs}" BUILDAH_ISOLATION="${BUILDAH_ISOLATION:-chroot}"
PULL_TIMEOUT_S="${GPUSCHED_IMAGE_PULL_TIMEOUT_S:-120}"
start=$(date +%s)

skip() { echo "image: skipped: $*"; exit 0; }

# The [project] table's version.
VERSION="$(awk -F'"' '/^\[/{p = ($0 == "[project]")} p && /^version *=/{print $2; exit}' pyproject.toml)"
[ -n "$VERSION" ] || { echo "image: no version in pyproject.toml's [project] table" >&2; exit 1; }
TAG="gpusched:$VERSION"

# Docker's reading of a short name: python:3.11-slim is docker.io/library/python:3.11-slim.
# buildah would otherwise ask registries.conf's search list, which may be empty or ambiguous.
qualify() {
  local ref="$1" first="${1%%/*}"
  if [ "$first" != "$ref" ] && { [[ "$first" == *.* ]] || [[ "$first" == *:* ]] || [ "$first" = localhost ]; }; then
    echo "$ref"
  elif [[ "$ref" == */* ]]; then
    echo "docker.io/$ref"
  else
    echo "docker.io/library/$ref"
  fi
}
BASE_REF="$(qualify "$BASE")"
REGISTRY="${BASE_REF%%/*}"

[ "$(id -u)" = 0 ] || skip "not root: this builds with buildah as root (vfs storage, chroot isolation); run \`sudo make image\`"
mkdir -p "$LOGDIR"

if ! command -v buildah >/dev/null; then
  command -v apt-get >/dev/null \
    || skip "buildah not found and no apt-get to install it; install buildah (https://buildah.io) and run make image again"
  echo "image: installing Debian's buildah (apt-get; log $LOGDIR/apt.log)" >&2
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y --no-install-recommends buildah >"$LOGDIR/apt.log" 2>&1 \
      || { apt-get update >>"$LOGDIR/apt.log" 2>&1 \
           && apt-get install -y --no-install-recommends buildah >>"$LOGDIR/apt.log" 2>&1; }; } \
    || skip "buildah not installed: apt-get install buildah failed (see $LOGDIR/apt.log); install buildah and run make image again"
fi
BUILDAH_VERSION="$(buildah --version | awk '{print $3}')"

buildah info >"$LOGDIR/info.log" 2>&1 \
  || skip "buildah $BUILDAH_VERSION cannot use $STORAGE_DRIVER storage here: $(grep -m1 -i 'error' "$LOGDIR/info.log" || tail -n1 "$LOGDIR/info.log") (see $LOGDIR/info.log)"

# The base image: pulled, or the copy already in buildah's storage when the pull fails.
pull_status=0
timeout "$PULL_TIMEOUT_S" buildah pull --quiet "$BASE_REF" >"$LOGDIR/pull.log" 2>&1 || pull_status=$?
if [ "$pull_status" != 0 ]; then
  if buildah inspect --type image "$BASE_REF" >/dev/null 2>&1; then
    echo "image: cannot pull $BASE_REF; using the copy already in buildah's storage (see $LOGDIR/pull.log)" >&2
  else
    log="$LOGDIR/pull.log"
    if [ "$pull_status" = 124 ]; then reason="no registry access: no answer within ${PULL_TIMEOUT_S}s"
    elif m="$(grep -m1 -o 'no such host\|connection refused\|i/o timeout\|network is unreachable\|TLS handshake timeout\|certificate signed by unknown authority' "$log")"; then
      reason="no registry access: $m"
    elif m="$(grep -m1 -io 'unauthorized[^"]*\|denied[^"]*' "$log")"; then reason="access refused: $m"
    elif grep -q -i 'manifest unknown\|not found' "$log"; then reason="no such image there"
    else reason="$(tail -n1 "$log" | cut -c1-200)"
    fi
    if [ -z "${GPUSCHED_BASE_IMAGE:-}" ]; then
      skip "cannot pull $BASE_REF from $REGISTRY ($reason; full error in $log); set GPUSCHED_BASE_IMAGE to a reachable mirror of python:3.11-slim, or run where $REGISTRY is reachable"
    fi
    skip "cannot pull GPUSCHED_BASE_IMAGE=$BASE_REF from $REGISTRY ($reason; full error in $log); point GPUSCHED_BASE_IMAGE at a reachable image, or \`buildah pull\` it first"
  fi
fi

echo "image: building $TAG from deploy/Dockerfile on $BASE_REF (buildah $BUILDAH_VERSION, $STORAGE_DRIVER storage, $BUILDAH_ISOLATION isolation)" >&2
if ! nice -n "${GPUSCHED_BUILD_NICE:-10}" buildah bud --pull=false --layers=false \
       --build-arg "BASE_IMAGE=$BASE_REF" -f deploy/Dockerfile -t "$TAG" . 2>&1 | tee "$LOGDIR/build.log" >&2; then
  echo "image: buildah bud failed: $(grep -m1 '^Error' "$LOGDIR/build.log" || echo 'see the log') (log $LOGDIR/build.log)" >&2
  exit 1
fi

ID="$(buildah inspect --type image --format '{{.FromImageID}}' "$TAG" | cut -c1-12)"
echo "image: built localhost/$TAG ($ID) in $(( $(date +%s) - start ))s; in buildah's $STORAGE_DRIVER storage: push it with \`buildah --storage-driver $STORAGE_DRIVER push $TAG docker://REGISTRY/gpusched:$VERSION\`"
