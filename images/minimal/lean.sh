#!/bin/sh
# A lean first boot for the minimal image (issue 15). $1 is the image's root directory.
# Runs after common/customize.sh. Stock cloud images are not touched by any of this: they boot
# with their own configuration and the same standard NoCloud seed.
set -eu
root="$1"

# The cloud kernel has virtio_blk and ext4 as modules, so an initramfs stays, but one of our own:
# initramfs-tools' (about 1.8 s under TCG: udev, its scripts, hooks for storage a sandbox has
# not) becomes busybox and an /init that loads the three modules with their dependencies, mounts
# the root read-write and hands over to systemd. It reads root= and rootdelay= from the kernel
# command line and, when the root never shows up, says what initramfs-tools says (vmsandbox's
# boot watcher fails the create on those lines).
kver=$(ls "$root/lib/modules")
work="$root/tmp/vmsandbox-initrd"
mkdir -p "$work/bin" "$work/dev" "$work/proc" "$work/root"
cp "$root/bin/busybox" "$work/bin/busybox"
for module in $(for name in virtio_pci virtio_blk ext4; do
                  chroot "$root" modprobe --show-depends --set-version "$kver" "$name"
                done | awk '$1 == "insmod" && !seen[$2]++ {print $2}'); do
  case "$module" in *.ko) ;; *) echo "unexpected module file $module" >&2; exit 1 ;; esac
  mkdir -p "$work$(dirname "$module")"
  cp "$root$module" "$work$module"
  echo "$module" >> "$work/modules"
done
cat > "$work/init" <<'INIT'
#!/bin/busybox sh
# vmsandbox's initramfs: the root's modules, the root, then systemd (images/minimal/lean.sh).
b=/bin/busybox
$b mount -t devtmpfs devtmpfs /dev
$b mount -t proc proc /proc
for module in $($b cat /modules); do $b insmod "$module"; done
rootdev=/dev/vda delay=0
for arg in $($b cat /proc/cmdline); do
  case "$arg" in root=*) rootdev=${arg#root=} ;; rootdelay=*) delay=${arg#rootdelay=} ;; esac
done
tries=$(( (delay + 30) * 20 ))
while [ ! -b "$rootdev" ] && [ "$tries" -gt 0 ]; do $b usleep 50000; tries=$((tries - 1)); done
if [ ! -b "$rootdev" ]; then
  echo "Gave up waiting for root file system device."
  echo "ALERT!  $rootdev does not exist.  Dropping to a shell!"
  exec $b sh
fi
$b mount -t ext4 -o rw "$rootdev" /root || exec $b sh
$b umount /proc
$b mount --move /dev /root/dev
exec $b switch_root /root /sbin/init
INIT
chmod 0755 "$work/init"
chroot "$root" sh -c 'cd /tmp/vmsandbox-initrd && find . | cpio --quiet -o -H newc' \
  > "$root/boot/initrd.img-$kver"
rm -rf "$work"

# sshd's config is baked and checked at build time: skip its `sshd -t` before every start (one
# more sshd process on the single vCPU on the way to SSH).
mkdir -p "$root/etc/systemd/system/ssh.service.d"
printf '[Service]\nExecStartPre=\n' > "$root/etc/systemd/system/ssh.service.d/90-vmsandbox.conf"
mkdir -p "$root/run/sshd"
chroot "$root" ssh-keygen -q -t ed25519 -N '' -f /tmp/check_host_key
chroot "$root" /usr/sbin/sshd -t -h /tmp/check_host_key
rm -rf "$root"/tmp/check_host_key* "$root/run/sshd"

# Units a sandbox never needs: system users from sysusers.d (the packages made them at build
# time; at boot it sat early in the chain to sshd, before udev), periodic maintenance, the text
# console (the serial one stays), binfmt_misc, and loading modules for hardware a sandbox has not
# (DRM, EFI pstore) or that load on first use anyway (fuse, loop, device-mapper: their /dev
# nodes are made at boot). Each is one more process on the single vCPU while the guest boots.
for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service \
            fstrim.timer man-db.timer getty@tty1.service systemd-binfmt.service \
            systemd-sysusers.service modprobe@drm.service modprobe@efi_pstore.service modprobe@fuse.service \
            modprobe@loop.service modprobe@dm_mod.service; do
  ln -sf /dev/null "$root/etc/systemd/system/$unit"
done

# Units a sandbox needs, but not before sshd: the system bus (networkd asks for it without
# waiting), the login manager and the serial console's login prompt start once sshd has, so they
# do not share the vCPU with the way to it.
for unit in dbus.service systemd-logind.service serial-getty@ttyS0.service; do
  mkdir -p "$root/etc/systemd/system/$unit.d"
  printf '[Unit]\nAfter=ssh.service\n' > "$root/etc/systemd/system/$unit.d/90-vmsandbox.conf"
done

# Every SSH session (each `vmsandbox exec`, a pool claim) ran the update-motd.d scripts (run-parts,
# a shell and uname) through pam_motd before the command; the static /etc/motd still shows.
sed -i '/pam_motd\.so.*motd=\/run\/motd\.dynamic/d' "$root/etc/pam.d/sshd"
