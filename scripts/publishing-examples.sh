#!/usr/bin/env bash
# Build (once) what the publishing examples need beyond Python, into ~/.cache/gpusched: the Go
# example (examples/publishing/go, github.com/nats-io/nats.go from the Go module proxy) and the
# JavaScript example's node_modules (the `nats` npm package, from package-lock.json). Keyed by a
# hash of the sources. Prints "go <binary>" and "js <node_modules dir>", each only when its
# toolchain (go, npm) is on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/gpusched"
mkdir -p "$CACHE"
exec 9>"$CACHE/.publishing-examples.lock"
flock 9

if command -v go >/dev/null; then
  src="$ROOT/examples/publishing/go"
  key="$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-12)"
  bin="$CACHE/publishing-go-$key/publish"
  if [ ! -x "$bin" ]; then
    mkdir -p "$(dirname "$bin")"
    (cd "$src" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" \
       nice -n "${GPUSCHED_BUILD_NICE:-10}" go build -trimpath -o "$bin.tmp" .) >&2
    mv "$bin.tmp" "$bin"
  fi
  echo "go $bin"
fi

if command -v npm >/dev/null && command -v node >/dev/null; then
  src="$ROOT/examples/publishing/js"
  key="$(cat "$src/package.json" "$src/package-lock.json" | sha256sum | cut -c1-12)"
  dir="$CACHE/publishing-js-$key"
  if [ ! -d "$dir/node_modules/nats" ]; then
    rm -rf "$dir" && mkdir -p "$dir"
    cp "$src/package.json" "$src/package-lock.json" "$dir/"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error) >&2
  fi
  echo "js $dir/node_modules"
fi
