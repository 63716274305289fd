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

# Units a sandbox never needs: periodic maintenance and the text console (the serial one stays).
for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service \
            fstrim.timer man-db.timer getty@tty1.service; do
  ln -sf /dev/null "$root/etc/systemd/system/$unit"
done
