#!/bin/sh
# Installs Debian's promtool (package prometheus) into .cache/promtool without root-owned files
# outside the repository: `apt-get download` + `dpkg -x`. Prints the binary's path.
# Idempotent; used by `make promtool` and tests/integration/test_accounting_ledger.py.
set -eu
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/.cache/promtool"
BIN="$DEST/usr/bin/promtool"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
command -v apt-get >/dev/null || { echo "promtool.sh: apt-get not found (Debian/Ubuntu only); set PROMTOOL=/path/to/promtool" >&2; exit 1; }
mkdir -p "$DEST/deb"
cd "$DEST/deb"
apt-get download prometheus >/dev/null 2>"$DEST/apt.log" || {
  echo "promtool.sh: apt-get download prometheus failed (see $DEST/apt.log; try apt-get update)" >&2; exit 1; }
dpkg -x prometheus_*.deb "$DEST"
rm -rf "$DEST/deb" "$DEST/usr/share" "$DEST/usr/bin/prometheus"
test -x "$BIN"
echo "$BIN"
