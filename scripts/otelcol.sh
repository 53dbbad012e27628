#!/usr/bin/env bash
# Build (once) and cache the OpenTelemetry Collector the tests export traces to: the collector's
# own modules with the OTLP receiver and the contrib file exporter (tests/otelcol: main.go, with
# go.mod and go.sum pinning every module), from the Go module proxy. Nothing is written inside
# the repository. Prints the binary's path on its last line.
#
#   scripts/otelcol.sh            # make otelcol; tests/otelcol/__init__.py calls it too
#
# Cold: see docs/testing.md; cached: instant. The cache is keyed by the module files and the Go
# version, so a bump rebuilds.
set -euo pipefail

SRC="$(cd "$(dirname "$0")/../tests/otelcol" && pwd)"
CACHE_ROOT="${GPUSCHED_OTELCOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpusched}"
KEY="$(cat "$SRC/go.mod" "$SRC/go.sum" "$SRC/main.go" | sha256sum | cut -c1-12)-$(go env GOVERSION)"
DEST="$CACHE_ROOT/otelcol-$KEY"
BIN="$DEST/bin/otelcol"

build() {
  cp "$SRC/go.mod" "$SRC/go.sum" "$SRC/main.go" .
  GOFLAGS="-mod=readonly -buildvcs=false" nice -n "${GPUSCHED_BUILD_NICE:-10}" \
    go build -trimpath -ldflags "-s -w" -o otelcol .
}

source "$(dirname "$0")/lib/build-once.sh"
build_once otelcol "$BIN" build
