#!/usr/bin/env bash
# `make test`: the unit tier while the test tools build, then everything else.
#
#   scripts/test.sh [PYTEST ARGS...]      # make test ARGS=...; the arguments go to both pytest runs
#
# 1. In the background: `make chromium` (Debian's, for the console's browser tests), and `make -j` of
#    the tools built from the registries (BUILT_TOOLS: natscli, otelcol, publishing-examples,
#    verifiers, focus-validator), in parallel and niced. Each is built or fetched once per machine
#    (cached outside the repository) and is instant when it is there. Their output: .cache/tools.log.
# 2. tests/unit meanwhile, on UNIT_WORKERS pytest-xdist workers (default: the number of cores), a
#    test file per worker at a time (its module fixtures built once).
# 3. Once chromium is there, tests/ but the unit tier, on REST_WORKERS pytest-xdist workers (0: one
#    process), a file per worker at a time, each worker with its own nats-server and Postgres. The
#    builds may still be running: a test that needs one of them calls its script, which waits on the
#    build's lock and then finds the binary; a failed build fails it.
# 4. e2e/ (less what the Makefile deselects: HEAVY_E2E), in one process: its stacks keep deadlines
#    on the platform clock that a busy machine can miss.
# The exit status is the first failing step's (pytest's "no test collected", 5, counts as passing for
# a step when another one ran tests, as when ARGS selects tests of one tier only).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON_BIN:-.venv/bin/python}"
MAKE="${MAKE:-make}"
WORKERS="${UNIT_WORKERS:-$(nproc)}"
mkdir -p .cache
LOG=.cache/tools.log
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start ))s"; }

BUILT="${BUILT_TOOLS:-natscli otelcol publishing-examples verifiers focus-validator}"
: >"$LOG"
"$MAKE" --no-print-directory chromium >>"$LOG" 2>&1 &
browser=$!
# shellcheck disable=SC2086  # BUILT is a list of make targets
"$MAKE" --no-print-directory -j $BUILT >>"$LOG" 2>&1 &
builds=$!
trap 'kill "$browser" "$builds" 2>/dev/null' INT TERM

"$PY" -m pytest -q -n "$WORKERS" --dist loadfile tests/unit "$@"
unit=$?
echo "make test: unit tier done at $(elapsed) (exit $unit)"

tools_failed() {
  tail -n 40 "$LOG" >&2
  echo "make test: $1 failed (above; whole log: $LOG); \`make tools\` tries again" >&2
  exit 1
}
wait "$browser" || tools_failed "make chromium"

workers=()
if [ "${REST_WORKERS:-0}" -gt 0 ]; then workers=(-n "$REST_WORKERS" --dist loadfile); fi
export GPUSCHED_REQUIRE_BROWSER="${GPUSCHED_REQUIRE_BROWSER:-1}"
"$PY" -m pytest -q "${workers[@]}" tests --ignore=tests/unit "$@"
rest=$?
echo "make test: tests/ done at $(elapsed) (exit $rest)"
"$PY" -m pytest -q e2e "$@"
e2e=$?
wait "$builds" || tools_failed "make -j $BUILT"
echo "make test: done at $(elapsed) (exit: unit tier $unit, tests/ $rest, e2e/ $e2e)"

# 5 (no test collected) passes a step when another step ran tests, as when ARGS selects one tier.
codes=("$unit" "$rest" "$e2e")
ran=0
for c in "${codes[@]}"; do [ "$c" = 5 ] || ran=1; done
for c in "${codes[@]}"; do
  if [ "$c" = 5 ] && [ "$ran" = 1 ]; then continue; fi
  if [ "$c" != 0 ]; then exit "$c"; fi
done
exit 0
