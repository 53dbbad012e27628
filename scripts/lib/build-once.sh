# Sourced by the scripts that build a test binary from the Go module proxy into a cache outside
# the repository (scripts/natscli.sh, scripts/otelcol.sh).
#
#   build_once LABEL BIN BUILD
#
# Prints BIN if it is there. Otherwise, holding a lock beside it (make and parallel pytest
# workers may ask at once: the others wait, then reuse it), runs the shell function BUILD in a
# fresh directory, where it must leave the binary under BIN's file name; moves it to BIN (so a
# build cut short never leaves a half-written binary there), checks that it runs (--version) and
# prints BIN. The build's output goes to stderr.

build_once() {
  local label="$1" bin="$2" build="$3" dest start
  dest="$(dirname "$(dirname "$bin")")"
  if [ -x "$bin" ]; then echo "$bin"; return 0; fi
  command -v go >/dev/null || { echo "$label: go not found on PATH (needed to build it)" >&2; return 1; }
  command -v flock >/dev/null || { echo "$label: flock not found (util-linux)" >&2; return 1; }
  mkdir -p "$dest"
  exec 9>"$dest/.lock"
  flock 9
  if [ -x "$bin" ]; then echo "$bin"; return 0; fi

  start=$(date +%s)
  echo "[$label] building into $dest/bin" >&2
  BUILD_ONCE_WORK="$(mktemp -d "$dest/.build.XXXXXX")"
  trap 'rm -rf "$BUILD_ONCE_WORK"' EXIT
  (cd "$BUILD_ONCE_WORK" && export CGO_ENABLED=0 GOTOOLCHAIN=local && "$build") >&2
  mkdir -p "$dest/bin"
  mv "$BUILD_ONCE_WORK/$(basename "$bin")" "$bin"
  "$bin" --version >/dev/null
  echo "[$label] built in $(( $(date +%s) - start ))s" >&2
  echo "$bin"
}
