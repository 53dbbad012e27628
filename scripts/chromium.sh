#!/bin/sh
# Installs Debian's chromium (the browser the console tests drive with Playwright) when
# /usr/bin/chromium is missing, and prints its path. Idempotent; used by `make chromium`.
# It needs root and apt-get (Debian or Ubuntu); elsewhere set GPUSCHED_CHROMIUM to a Chromium binary.
set -eu
BIN="${GPUSCHED_CHROMIUM:-/usr/bin/chromium}"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
command -v apt-get >/dev/null || { echo "chromium.sh: apt-get not found; set GPUSCHED_CHROMIUM=/path/to/chromium" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "chromium.sh: installing Debian's chromium needs root (or set GPUSCHED_CHROMIUM)" >&2; exit 1; }
LOG="${TMPDIR:-/tmp}/gpusched-chromium-install.log"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends chromium >"$LOG" 2>&1 || {
  apt-get update >>"$LOG" 2>&1 && apt-get install -y --no-install-recommends chromium >>"$LOG" 2>&1; } || {
  echo "chromium.sh: apt-get install chromium failed; see $LOG" >&2; exit 1; }
test -x "$BIN"
echo "$BIN"
