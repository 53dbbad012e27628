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

if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
command -v go >/dev/null || { echo "otelcol.sh: go not found on PATH (needed to build the collector)" >&2; exit 1; }
mkdir -p "$DEST"
exec 9>"$DEST/.lock"   # one build at a time; the others wait, then reuse it
flock 9
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

start=$(date +%s)
echo "[otelcol] building into $DEST/bin" >&2
work="$(mktemp -d "$DEST/.build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp "$SRC/go.mod" "$SRC/go.sum" "$SRC/main.go" "$work/"
(cd "$work" && CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false" GOTOOLCHAIN=local \
  nice -n "${GPUSCHED_BUILD_NICE:-10}" go build -trimpath -ldflags "-s -w" -o otelcol . >&2)
mkdir -p "$DEST/bin"
mv "$work/otelcol" "$BIN"
"$BIN" --version >/dev/null
echo "[otelcol] built in $(( $(date +%s) - start ))s" >&2
echo "$BIN"
