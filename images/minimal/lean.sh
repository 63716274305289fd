#!/bin/sh
# A lean first boot for the minimal image (issue 15). $1 is the image's root directory.
# Runs after common/customize.sh. Stock cloud images are not touched by any of this: they boot
# with their own configuration and the same standard NoCloud seed.
set -eu
root="$1"

# The cloud kernel has virtio_blk and ext4 as modules, so an initramfs stays, but one of our own:
# initramfs-tools' (about 1.8 s under TCG: udev, its scripts, hooks for storage a sandbox has
# not) becomes busybox and an /init that loads the root's modules and the NIC's with their
# dependencies, mounts the root read-write and hands over to systemd. The NIC is there from the
# start, so the first-boot unit gives it its address before sshd starts; with
# vmsandbox.nic=late on the kernel command line (guests booting with passed GPUs: see
# LATE_NIC_ARG in vmsandbox/image/build.py) its driver is left to udev. /init reads root= and
# rootdelay= from the kernel command line too and, when the root never shows up, says what
# initramfs-tools says (vmsandbox's boot watcher fails the create on those lines).
kver=$(ls "$root/lib/modules")
work="$root/tmp/vmsandbox-initrd"
mkdir -p "$work/bin" "$work/dev" "$work/proc" "$work/root"
cp "$root/bin/busybox" "$work/bin/busybox"
# $1: the list file in the initramfs; the rest: modules, loaded with their dependencies.
add_modules() {
  list="$1"
  shift
  for module in $(for name in "$@"; do
                    chroot "$root" modprobe --show-depends --set-version "$kver" "$name"
                  done | awk '$1 == "insmod" {print $2}'); do
    case "$module" in *.ko) ;; *) echo "unexpected module file $module" >&2; exit 1 ;; esac
    [ -e "$work$module" ] && continue
    mkdir -p "$work$(dirname "$module")"
    cp "$root$module" "$work$module"
    echo "$module" >> "$work/$list"
  done
}
: > "$work/modules.nic"
add_modules modules virtio_pci virtio_blk ext4
add_modules modules.nic virtio_net
cat > "$work/init" <<'INIT'
#!/bin/busybox sh
# vmsandbox's initramfs: the root's modules, the root, then systemd (images/minimal/lean.sh).
b=/bin/busybox
$b mount -t devtmpfs devtmpfs /dev
$b mount -t proc proc /proc
for module in $($b cat /modules); do $b insmod "$module"; done
rootdev=/dev/vda delay=0 nic=early
for arg in $($b cat /proc/cmdline); do
  case "$arg" in
    root=*) rootdev=${arg#root=} ;;
    rootdelay=*) delay=${arg#rootdelay=} ;;
    vmsandbox.nic=late) nic=late ;;
  esac
done
if [ "$nic" = early ]; then
  for module in $($b cat /modules.nic); do $b insmod "$module"; done
fi
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

# sshd listens on every address and needs no network to start: it starts once the first-boot
# unit is done (the unit gives static NICs their addresses), not after networkd. Debian's unit
# orders it after network.target, which a drop-in cannot take back: the unit is copied here.
sed -e '/^After=/s/network\.target *//' "$root/lib/systemd/system/ssh.service" \
  > "$root/etc/systemd/system/ssh.service"
grep -q '^After=auditd.service$' "$root/etc/systemd/system/ssh.service"
# Likewise logins: systemd makes /run/nologin at boot (pam_nologin then refuses every user but
# root) and removes it only after network.target (systemd-user-sessions.service). Here sshd
# starts once the guest is set up for its user, so the file is not made.
mkdir -p "$root/etc/tmpfiles.d"
ln -sf /dev/null "$root/etc/tmpfiles.d/systemd-nologin.conf"

# sshd's config is baked and checked at build time: skip its `sshd -t` before every start (one
# more sshd process on the single vCPU on the way to SSH).
# While the guest boots, sshd (and the sessions it serves) gets ten times the CPU share of any
# other unit: once it listens, its first handshake shares the vCPU with the units that start
# after it (below). Only during startup: afterwards every unit weighs the same again.
mkdir -p "$root/etc/systemd/system/ssh.service.d"
printf '[Service]\nExecStartPre=\nStartupCPUWeight=1000\n' \
  > "$root/etc/systemd/system/ssh.service.d/90-vmsandbox.conf"
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

# Generators systemd runs before it loads any unit (each one a program start, about 80 ms of the
# vCPU here) for what a sandbox has not: SysV init scripts (every service here has its own
# unit), encrypted, verity and integrity volumes, GPT partition discovery, hibernation, offline
# updates, systemd.run= on the kernel command line. The fstab, getty, debug (systemd.mask= on the
# kernel command line) and rc.local generators stay. Also off: networkd units made from ip= on
# the kernel command line (never given), and the module list of /etc/modules (empty here;
# modules-load.d files a guest setup adds still load).
mkdir -p "$root/etc/systemd/system-generators"
for generator in systemd-sysv-generator systemd-cryptsetup-generator systemd-veritysetup-generator \
                 systemd-integritysetup-generator systemd-gpt-auto-generator \
                 systemd-hibernate-resume-generator systemd-system-update-generator \
                 systemd-run-generator; do
  ln -sf /dev/null "$root/etc/systemd/system-generators/$generator"
done
ln -sf /dev/null "$root/etc/systemd/system/systemd-network-generator.service"
if ! grep -qv '^[[:space:]]*\(#\|$\)' "$root/etc/modules"; then
  rm -f "$root/etc/modules-load.d/modules.conf"
fi

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

# Coldplug (udev replaying the "add" events of devices that were there before it started: about
# 280 here, one second of the vCPU) in two parts. Before sshd only what the way to it needs: the
# virtio devices (their drivers load: the NIC appears, then its own events come as they happen)
# and the disks. Every other device (ACPI and the power button that a graceful stop presses,
# input, ttys, PCI and the drivers of passed devices) once sshd has started.
mkdir -p "$root/etc/systemd/system/systemd-udev-trigger.service.d"
cat > "$root/etc/systemd/system/systemd-udev-trigger.service.d/90-vmsandbox.conf" <<'UNIT'
[Service]
ExecStart=
ExecStart=-udevadm trigger --type=devices --action=add --subsystem-match=virtio --subsystem-match=net --subsystem-match=block
UNIT
cat > "$root/etc/systemd/system/vmsandbox-coldplug.service" <<'UNIT'
[Unit]
Description=vmsandbox: coldplug the devices a sandbox needs after sshd
DefaultDependencies=no
Wants=systemd-udevd.service
After=systemd-udev-trigger.service ssh.service
Before=multi-user.target shutdown.target
Conflicts=shutdown.target
ConditionPathIsReadWrite=/sys

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=-udevadm trigger --type=all --action=add --subsystem-nomatch=virtio --subsystem-nomatch=net --subsystem-nomatch=block

[Install]
WantedBy=multi-user.target
UNIT
systemctl --root="$root" --quiet enable vmsandbox-coldplug.service

# The journal lives in memory (/run): no journal files written to each sandbox's disk at every
# boot, and no flush to /var (its unit masked: the start of sysinit's file setup waited for it,
# and so for journald). The image's random seed file is dropped and its unit masked: every
# sandbox would start from the same file, while the kernel seeds itself (RDRAND, virtio-rng).
mkdir -p "$root/etc/systemd/journald.conf.d"
printf '[Journal]\nStorage=volatile\n' > "$root/etc/systemd/journald.conf.d/90-vmsandbox.conf"
rm -rf "$root/var/log/journal"
ln -sf /dev/null "$root/etc/systemd/system/systemd-journal-flush.service"
rm -f "$root/var/lib/systemd/random-seed"
ln -sf /dev/null "$root/etc/systemd/system/systemd-random-seed.service"
