#!/bin/sh
# A lean first boot for the minimal image (issue 15). $1 is the image's root directory.
# Runs after common/customize.sh. Stock cloud images are not touched by any of this: they boot
# with their own configuration and the same standard NoCloud seed.
set -eu
root="$1"

# The cloud kernel has virtio_blk and ext4 as modules, so an initramfs stays, but a small one:
# only what mounts the root (the default packs every storage and network driver, about 50 MB
# that the guest decompresses under TCG at every boot).
mkdir -p "$root/etc/initramfs-tools/conf.d"
printf 'MODULES=list\n' > "$root/etc/initramfs-tools/conf.d/90-vmsandbox"
printf 'virtio_pci\nvirtio_blk\next4\n' >> "$root/etc/initramfs-tools/modules"
chroot "$root" update-initramfs -u -k all >/dev/null

# sshd's config is baked and checked at build time: skip its `sshd -t` before every start (one
# more sshd process on the single vCPU on the way to SSH).
mkdir -p "$root/etc/systemd/system/ssh.service.d"
printf '[Service]\nExecStartPre=\n' > "$root/etc/systemd/system/ssh.service.d/90-vmsandbox.conf"
mkdir -p "$root/run/sshd"
chroot "$root" ssh-keygen -q -t ed25519 -N '' -f /tmp/check_host_key
chroot "$root" /usr/sbin/sshd -t -h /tmp/check_host_key
rm -rf "$root"/tmp/check_host_key* "$root/run/sshd"

# Units a sandbox never needs: periodic maintenance, the text console (the serial one stays),
# binfmt_misc, and loading modules for hardware a sandbox has not (DRM, EFI pstore) or that load
# on first use anyway (fuse, loop, device-mapper: their /dev nodes are made at boot). Each is one
# more process on the single vCPU while the guest boots.
for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service \
            fstrim.timer man-db.timer getty@tty1.service systemd-binfmt.service \
            modprobe@drm.service modprobe@efi_pstore.service modprobe@fuse.service \
            modprobe@loop.service modprobe@dm_mod.service; do
  ln -sf /dev/null "$root/etc/systemd/system/$unit"
done

# Units a sandbox needs, but not before sshd: the login manager (started on the first login's
# PAM session if it has not started by then) and the serial console's login prompt start once
# sshd has, so they do not share the vCPU with the way to it.
for unit in systemd-logind.service serial-getty@ttyS0.service; do
  mkdir -p "$root/etc/systemd/system/$unit.d"
  printf '[Unit]\nAfter=ssh.service\n' > "$root/etc/systemd/system/$unit.d/90-vmsandbox.conf"
done

# Every SSH session (each `vmsandbox exec`, a pool claim) ran the update-motd.d scripts (run-parts,
# a shell and uname) through pam_motd before the command; the static /etc/motd still shows.
sed -i '/pam_motd\.so.*motd=\/run\/motd\.dynamic/d' "$root/etc/pam.d/sshd"
