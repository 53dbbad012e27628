#!/usr/bin/env bash
# The FinOps Foundation's focus-validator (PyPI, 2.2.1: FOCUS 1.2) in its own venv under ~/.cache/gpusched, for
# the FOCUS export's test (docs/accounting.md#focus-export). Prints the venv's focus-validator path.
# It needs Python >= 3.12 and pins numpy < 2 (wheels up to 3.12): a python3.12 (on PATH or pyenv's), else 3.13;
# pyarrow < 21 beside it (pyarrow >= 21 wants numpy 2). Its own venv: its pins are not the project's.
set -euo pipefail
VERSION=2.2.1
PY=""
for p in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3.13 "$HOME"/.pyenv/versions/3.13*/bin/python3.13; do
  if "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then PY=$p; break; fi
done
[ -n "$PY" ] || { echo "focus-validator $VERSION needs python3.12 or 3.13 (PATH or ~/.pyenv/versions); none runs here" >&2; exit 1; }
VENV="${GPUSCHED_CACHE:-$HOME/.cache/gpusched}/focus-validator-$VERSION-$("$PY" -c 'import sys; print("py%d%d" % sys.version_info[:2])')"
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"  # make -j tools and a test may ask at once: one installs, the other waits
flock 9
if [ ! -f "$VENV/.ok" ]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "focus-validator==$VERSION" "pyarrow<21" >&2
  (cd "$VENV" && "$VENV/bin/focus-validator" --help >/dev/null)  # it writes a log where it runs
  touch "$VENV/.ok"
fi
echo "$VENV/bin/focus-validator"
