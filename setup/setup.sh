#!/usr/bin/env bash
# One-command, idempotent setup of a Debian 12 host for vmsandbox (run as root):
# Debian packages, libvirtd running, a virtualenv with vmsandbox installed, and the guest images
# named in $VMSANDBOX_IMAGES (default: minimal) built unless already cached.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGES="${VMSANDBOX_IMAGES:-minimal}"
VENV="${VENV:-.venv}"
PACKAGES=(
  libvirt-daemon-system libvirt-clients libvirt-daemon-driver-qemu qemu-system-x86 qemu-utils
  ovmf libvirt-dev pkg-config python3-venv python3-dev gcc mmdebstrap e2fsprogs umockdev
  openssh-client genisoimage pciutils libxml2-utils ca-certificates make
  busybox-static
)
# Packages only some jobs need (make bench adds virtinst for its virt-install baseline).
read -r -a EXTRA <<< "${VMSANDBOX_EXTRA_PACKAGES:-}"
PACKAGES+=("${EXTRA[@]}")

say() { printf '[setup] %s\n' "$*" >&2; }

if [ "$(id -u)" != 0 ]; then
  say "run as root (it installs packages, starts libvirtd and writes /var/lib/vmsandbox)"; exit 1
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Debian's udev rule gives /dev/kvm to group kvm (mode 0660); hosts without udev (containers) leave
# it root-only, and libvirt then re-probes QEMU on every call because the answer looks stale.
if [ -c /dev/kvm ] && getent group kvm >/dev/null; then
  chgrp kvm /dev/kvm && chmod 0660 /dev/kvm
fi

libvirt_up() { virsh -q -c qemu:///system version >/dev/null 2>&1; }
if ! libvirt_up; then
  if [ -d /run/systemd/system ]; then
    say "starting libvirtd through systemd"
    systemctl enable --now virtlogd.socket libvirtd.socket libvirtd.service >/dev/null
  else
    say "no systemd here: starting virtlogd and libvirtd as daemons"
    pgrep -x virtlogd >/dev/null || virtlogd -d
    pgrep -x libvirtd >/dev/null || libvirtd -d
  fi
  for _ in $(seq 1 100); do libvirt_up && break; sleep 0.1; done
  libvirt_up || { say "libvirtd did not come up"; exit 1; }
fi

stamp="$VENV/.installed"
if [ ! -x "$VENV/bin/python" ] || [ pyproject.toml -nt "$stamp" ]; then
  say "creating virtualenv $VENV and installing vmsandbox"
  /usr/bin/python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -U pip
  "$VENV/bin/pip" install -q --disable-pip-version-check -e '.[test,fleet]'
  touch "$stamp"
fi
# The gRPC stubs of the OpenShell driver are generated, never committed; the editable install
# uses the source tree, so they are made there (cheap: protoc runs in a second).
"$VENV/bin/python" setup/gen_proto.py .

for image in $IMAGES; do
  "$VENV/bin/vmsandbox" images build "$image"
done
say "ready"
