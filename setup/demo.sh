#!/usr/bin/env bash
# The main job, end to end: create a sandbox, run commands in it over SSH, print what the guest
# said, destroy it (also when something fails).
set -euo pipefail
cd "$(dirname "$0")/.."
name="demo-$(date +%s)"
trap '.venv/bin/vmsandbox destroy "$name" >/dev/null 2>&1 || true' EXIT
.venv/bin/vmsandbox create "$name"
echo "--- inside the guest, over SSH with the pinned host key ---"
.venv/bin/vmsandbox exec "$name" -- sh -c 'echo "kernel:   $(uname -r)"; echo "hostname: $(cat /etc/hostname)"; echo "user:     $(id -un)"'
.venv/bin/vmsandbox destroy "$name"
trap - EXIT
