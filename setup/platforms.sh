#!/usr/bin/env bash
# The virtualenv of other platforms' SDKs (.venv-platforms at the repository top), with the
# packages pinned in setup/platforms.txt. Idempotent: a venv already made from the same list
# is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-platforms
made_from="$venv/.platforms.txt"
if [ -x "$venv/bin/python" ] && cmp -s setup/platforms.txt "$made_from"; then
    exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check -r setup/platforms.txt
cp setup/platforms.txt "$made_from"
echo "platform SDKs installed in $venv: $(grep -v '^#' setup/platforms.txt | xargs)"
