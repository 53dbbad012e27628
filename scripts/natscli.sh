#!/usr/bin/env bash
# Build (once) and cache the plain `nats` CLI (github.com/nats-io/natscli) from the Go module proxy,
# for the tests that act as a team would with nothing but a credential and this binary.
# Nothing is written inside the repository. Prints the binary's path on its last line.
#
#   scripts/natscli.sh            # make natscli; tests/natscli.py calls it too
#
# Cold: about 35 s on the 2-core development VM (module download and build); cached: instant. GPUSCHED_NATSCLI_VERSION picks another
# version (the cache is keyed by it).
set -euo pipefail

VERSION="${GPUSCHED_NATSCLI_VERSION:-v0.5.0}"
CACHE_ROOT="${GPUSCHED_NATSCLI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpusched}"
DEST="$CACHE_ROOT/natscli-$VERSION"
BIN="$DEST/bin/nats"

if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
command -v go >/dev/null || { echo "natscli.sh: go not found on PATH (needed to build nats $VERSION)" >&2; exit 1; }
command -v flock >/dev/null || { echo "natscli.sh: flock not found (util-linux)" >&2; exit 1; }

mkdir -p "$DEST"
# One build at a time (make and parallel pytest workers may ask at once); the others wait, then reuse it.
exec 9>"$DEST/.lock"
flock 9
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

start=$(date +%s)
echo "[natscli] building nats $VERSION into $DEST/bin" >&2
# Into a temporary GOBIN, then renamed: a build cut short never leaves a half-written binary at $BIN.
tmp="$(mktemp -d "$DEST/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
GOBIN="$tmp" CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local \
  nice -n "${GPUSCHED_BUILD_NICE:-10}" go install -trimpath -ldflags "-s -w -X main.version=$VERSION" \
  "github.com/nats-io/natscli/nats@$VERSION" >&2
mkdir -p "$DEST/bin"
mv "$tmp/nats" "$BIN"
"$BIN" --version >/dev/null
echo "[natscli] built in $(( $(date +%s) - start ))s" >&2
echo "$BIN"
