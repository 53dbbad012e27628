#!/usr/bin/env bash
# Build (once) the chargeback statement verifiers of examples/verify (docs/accounting.md), into
# ~/.cache/gpusched: the Go one (github.com/gowebpki/jcs from the Go module proxy, go.sum pinned)
# and the JavaScript one's node_modules (npm `canonicalize`, from package-lock.json). Keyed by a
# hash of the sources. Prints "go <binary>" and "js <script>", each only when its toolchain is on
# PATH (go also at /usr/local/go/bin).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/gpusched"
PATH="$PATH:/usr/local/go/bin"
mkdir -p "$CACHE"
exec 9>"$CACHE/.verifiers.lock"
flock 9

if command -v go >/dev/null; then
  src="$ROOT/examples/verify/go"
  key="$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-12)"
  bin="$CACHE/verify-go-$key/verify"
  if [ ! -x "$bin" ]; then
    mkdir -p "$(dirname "$bin")"
    (cd "$src" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" \
       nice -n "${GPUSCHED_BUILD_NICE:-10}" go build -trimpath -o "$bin.tmp" .) >&2
    mv "$bin.tmp" "$bin"
  fi
  echo "go $bin"
fi

if command -v npm >/dev/null && command -v node >/dev/null; then
  src="$ROOT/examples/verify/js"
  key="$(cat "$src/package.json" "$src/package-lock.json" "$src/verify.mjs" | sha256sum | cut -c1-12)"
  dir="$CACHE/verify-js-$key"
  if [ ! -d "$dir/node_modules/canonicalize" ]; then
    rm -rf "$dir" && mkdir -p "$dir"
    cp "$src/package.json" "$src/package-lock.json" "$dir/"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error) >&2
  fi
  cp "$src/verify.mjs" "$dir/verify.mjs"
  echo "js $dir/verify.mjs"
fi
