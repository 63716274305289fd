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

# cloud-init: only the modules a sandbox seed uses (the host key, the user and its key, the
# hostname, growing the filesystem to the overlay's size) plus write_files and runcmd for
# seeds that set a guest up. Each module left out is work the single vCPU no longer does while
# the client waits for sshd.
cat > "$root/etc/cloud/cloud.cfg.d/91-vmsandbox-lean.cfg" <<'CFG'
cloud_init_modules: [resizefs, write_files, set_hostname, update_hostname, update_etc_hosts,
  users_groups, ssh]
cloud_config_modules: [runcmd]
cloud_final_modules: [scripts_per_once, scripts_user]
CFG

# Units a sandbox never needs: periodic maintenance and the text console (the serial one stays).
for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service \
            fstrim.timer man-db.timer getty@tty1.service; do
  ln -sf /dev/null "$root/etc/systemd/system/$unit"
done
