#!/usr/bin/env bash
# Idempotent: the virtualenv .venv-platforms with the platforms' released packages
# (setup/platforms/requirements.txt, every dependency held by setup/platforms/constraints.txt),
# which tests/unit/compat/test_compat_platforms.py and tests/unit/openshell/test_request_sdk.py run as subprocesses.
# Rebuilt only when the pins or the interpreter change. flowmesh needs Python 3.12 or newer;
# Debian 12's python3 is 3.11, so the interpreter is $PLATFORMS_PYTHON, else python3.12 (the one
# the constraints were frozen with), 3.13 or 3.14 on PATH, else the oldest 3.12+ under pyenv.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${PLATFORMS_VENV:-.venv-platforms}"
REQUIREMENTS=setup/platforms/requirements.txt
CONSTRAINTS=setup/platforms/constraints.txt

say() { printf '[platforms] %s\n' "$*" >&2; }

is_312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

find_python() {
  local candidate
  if [ -n "${PLATFORMS_PYTHON:-}" ]; then
    is_312 "$PLATFORMS_PYTHON" && { echo "$PLATFORMS_PYTHON"; return; }
    say "PLATFORMS_PYTHON=$PLATFORMS_PYTHON is not Python 3.12 or newer"; return 1
  fi
  for candidate in python3.12 python3.13 python3.14; do
    if command -v "$candidate" >/dev/null && is_312 "$(command -v "$candidate")"; then
      command -v "$candidate"; return
    fi
  done
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  for candidate in $(ls -d "$root"/versions/3.1[2-9]* 2>/dev/null | sort -V); do
    if is_312 "$candidate/bin/python3"; then echo "$candidate/bin/python3"; return; fi
  done
  say "no Python 3.12 or newer found (flowmesh requires it): install one, or set PLATFORMS_PYTHON"
  return 1
}

python="$(find_python)"
key="$("$python" -c 'import sys; print(sys.version)' | head -1) $(cat "$REQUIREMENTS" "$CONSTRAINTS" | sha256sum | cut -c1-16)"
stamp="$VENV/.installed"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
  exit 0
fi
say "building $VENV with $python"
rm -rf "$VENV"
"$python" -m venv "$VENV"
# pip names every configured index location it skips; those lines are noise here.
"$VENV/bin/pip" install -q --disable-pip-version-check -r "$REQUIREMENTS" -c "$CONSTRAINTS" 2>&1 \
  | { grep -v "^WARNING: Location .* is ignored" || true; } >&2
echo "$key" > "$stamp"
say "ready"
