#!/bin/sh
# Shared customisation of every vmsandbox guest image. $1 is the image's root directory.
# Runs on the build host (mmdebstrap customize hook); uses chroot only for commands that must run
# inside the guest's own userland.
set -eu
root="$1"

# Root on the whole virtio disk (no partition table: the image is one ext4 filesystem).
printf '/dev/vda / ext4 defaults,errors=remount-ro 0 1\n' > "$root/etc/fstab"

# Host keys come from the NoCloud seed (pinned by the client): never bake any into the image.
rm -f "$root"/etc/ssh/ssh_host_*

# Key-only SSH is baked in: the first boot never rewrites sshd_config.
# ClientAliveInterval: a login whose host side went with a suspend (QEMU's network forward ends
# with its process, and the guest is never told) would otherwise stay in the guest until TCP's
# 2-hour keepalive; the first probe after the resume meets a reset and ends it.
mkdir -p "$root/etc/ssh/sshd_config.d"
printf '%s\n' 'PasswordAuthentication no' 'KbdInteractiveAuthentication no' \
  'PermitRootLogin no' 'ClientAliveInterval 15' \
  > "$root/etc/ssh/sshd_config.d/90-vmsandbox.conf"

# Serial console login for debugging through `virsh console`.
chroot "$root" systemctl enable serial-getty@ttyS0.service >/dev/null 2>&1 || true

# A machine id is created at first boot, so clones of the image differ.
: > "$root/etc/machine-id"
rm -f "$root/var/lib/dbus/machine-id"

# Slim the image: documentation, man pages and apt lists are not needed in a sandbox.
rm -rf "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/var/lib/apt/lists/* \
       "$root"/var/cache/apt/*.bin
