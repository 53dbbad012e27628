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

# Into the build directory (GOBIN), then moved into place by build_once.
build() {
  GOBIN="$PWD" GOFLAGS="-mod=mod -buildvcs=false" nice -n "${GPUSCHED_BUILD_NICE:-10}" \
    go install -trimpath -ldflags "-s -w -X main.version=$VERSION" "github.com/nats-io/natscli/nats@$VERSION"
}

source "$(dirname "$0")/lib/build-once.sh"
build_once natscli "$BIN" build
