#!/bin/sh
# A lean boot for vmsandbox's own images (minimal, nvidia): a sandbox answers SSH as soon as it
# can. $1 is the image's root directory. Runs after the other common scripts; an image's own
# lean steps (images/nvidia/lean.sh) run after it. Stock cloud images are not touched by any of
# this: they boot with their own configuration and the same standard NoCloud seed.
set -eu
root="$1"

# The cloud kernel has virtio_blk and ext4 as modules, so an initramfs stays, but one of our own:
# initramfs-tools' (about 1.8 s under TCG: udev, its scripts, hooks for storage a sandbox has
# not) becomes busybox and an /init that loads the root's modules and the NIC's with their
# dependencies, mounts the root read-write, applies the seed and hands over to systemd. The NIC is
# there from the start, so the seed's static address is on it before systemd starts; with
# vmsandbox.nic=late on the kernel command line (guests booting with passed GPUs: see
# LATE_NIC_ARG in vmsandbox/image/build.py) its driver is left to udev. /init reads root= and
# rootdelay= from the kernel command line too and, when the root never shows up, says what
# initramfs-tools says (vmsandbox's boot watcher fails the create on those lines).
#
# The seed: a seed that asks for no guest setup carries a plain-text file that
# /usr/lib/vmsandbox/firstboot_lean.sh (a guest tool, copied in here) applies with busybox:
# hostname, user, keys, NIC. Python's start alone (0.7 s of the vCPU here) and useradd (0.4 to
# 0.9 s) cost more than the whole of it. Any other seed is left to the Python unit
# (vmsandbox-firstboot.service), which skips a boot whose seed /init applied. Masking that unit
# (systemd.mask=vmsandbox-firstboot.service) masks this part too.
#
# /init prints "vmsandbox-boot: <event> at <uptime>s" lines on the console: the time of each
# stage of the boot in the guest's own clock, which bench/fast_start.py reads.
kver=$(ls "$root/lib/modules")
work="$root/tmp/vmsandbox-initrd"
mkdir -p "$work/bin" "$work/dev" "$work/proc" "$work/sys" "$work/root" "$work/seed"
cp "$root/bin/busybox" "$work/bin/busybox"
for applet in $(chroot "$root" /bin/busybox --list); do
  [ -e "$work/bin/$applet" ] || ln -s busybox "$work/bin/$applet"
done
install -m 0755 "$root/usr/lib/vmsandbox/firstboot_lean.sh" "$work/firstboot_lean.sh"
# $1: the list file in the initramfs; the rest: modules, loaded with their dependencies.
add_modules() {
  list="$1"
  shift
  : > "$work/$list"
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
add_modules modules virtio_pci virtio_blk ext4
add_modules modules.nic virtio_net
add_modules modules.seed isofs
cat > "$work/init" <<'INIT'
#!/bin/sh
# vmsandbox's initramfs: the root's modules, the root, the seed, then systemd
# (images/common/lean.sh).
export PATH=/bin
mount -t devtmpfs devtmpfs /dev
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mark() {
  read -r up _ < /proc/uptime
  echo "vmsandbox-boot: $1 at ${up}s"
}
mark "initramfs started"
while read -r module; do insmod "$module"; done < /modules
rootdev=/dev/vda delay=0 nic=early seed=yes
read -r cmdline < /proc/cmdline
for arg in $cmdline; do
  case "$arg" in
    root=*) rootdev=${arg#root=} ;;
    rootdelay=*) delay=${arg#rootdelay=} ;;
    vmsandbox.nic=late) nic=late ;;
    systemd.mask=vmsandbox-firstboot.service) seed=no ;;
  esac
done
if [ "$nic" = early ]; then
  while read -r module; do insmod "$module"; done < /modules.nic
fi
tries=$(( (delay + 30) * 20 ))
while [ ! -b "$rootdev" ] && [ "$tries" -gt 0 ]; do usleep 50000; tries=$((tries - 1)); done
if [ ! -b "$rootdev" ]; then
  echo "Gave up waiting for root file system device."
  echo "ALERT!  $rootdev does not exist.  Dropping to a shell!"
  exec sh
fi
mount -t ext4 -o rw "$rootdev" /root || exec sh
# /tmp starts empty at every boot, before anyone can log in (the image's tmpfiles rule for it
# no longer empties it: see lean.sh). Nothing is started when it is empty already.
for entry in /root/tmp/* /root/tmp/.[!.]* /root/tmp/..?*; do
  [ -e "$entry" ] || [ -L "$entry" ] || continue
  rm -rf "$entry"
done
# systemd keeps a /run that is there already: the seed's flag for the Python unit goes on it.
mount -t tmpfs -o mode=0755,nosuid,nodev,size=20%,nr_inodes=800k tmpfs /root/run
if [ "$seed" = yes ]; then
  while read -r module; do insmod "$module"; done < /modules.seed
  for device in /dev/vd?; do
    [ "$device" != "$rootdev" ] || continue
    label=$(dd if="$device" bs=1 skip=32808 count=7 2> /dev/null)
    [ "$label" = "cidata " ] && mount -t iso9660 -o ro "$device" /seed || continue
    sh /firstboot_lean.sh /seed /root "$device"
    [ "$?" = 3 ] || { mkdir -p /root/run/vmsandbox && : > /root/run/vmsandbox/firstboot-lean; }
    umount /seed
    break
  done
fi
mark "systemd starting"
for mounted in dev proc sys; do mount --move "/$mounted" "/root/$mounted"; done
exec switch_root /root /sbin/init
INIT
chmod 0755 "$work/init"
chroot "$root" sh -c 'cd /tmp/vmsandbox-initrd && find . | cpio --quiet -o -H newc' \
  > "$root/boot/initrd.img-$kver"
rm -rf "$work"
mkdir -p "$root/etc/systemd/system/vmsandbox-firstboot.service.d"
printf '[Unit]\nConditionPathExists=!/run/vmsandbox/firstboot-lean\n' \
  > "$root/etc/systemd/system/vmsandbox-firstboot.service.d/90-lean.conf"

# sshd first: the kernel command line (the recipe's kernel_args) boots
# vmsandbox-sshd.target, which holds only sshd, the root filesystem's growth to the disk's size
# (before sshd: images/common/firstboot.sh) and the Python first-boot unit, for seeds /init
# left to it; once sshd has started, vmsandbox-boot.service says so on the console and starts
# the default target, the rest of the boot (udev, journald, networkd, D-Bus, logind, the serial
# login...). sshd listens on every address and needs no network, no udev and no journald to
# start, so the copy of Debian's unit here has no default dependencies (which order it after
# the whole of sysinit.target and basic.target) and no After=network.target. A boot of the
# default target (another command line) starts it early too.
sed -e '/^After=/s/network\.target *//' \
    -e 's/^\[Unit\]$/[Unit]\nDefaultDependencies=no\nConflicts=shutdown.target\nBefore=shutdown.target/' \
  "$root/lib/systemd/system/ssh.service" > "$root/etc/systemd/system/ssh.service"
grep -q '^After=auditd.service$' "$root/etc/systemd/system/ssh.service"
grep -q '^DefaultDependencies=no$' "$root/etc/systemd/system/ssh.service"
# journald's sockets listen from the start (sshd's stdout and syslog lines wait in them), and
# journald itself starts once sshd has.
cat > "$root/etc/systemd/system/vmsandbox-sshd.target" <<'UNIT'
[Unit]
Description=vmsandbox: sshd first, then the rest of the boot
Wants=vmsandbox-firstboot.service vmsandbox-growfs.service ssh.service vmsandbox-boot.service
Wants=systemd-journald.socket systemd-journald-dev-log.socket
AllowIsolate=yes
UNIT
# Its console line (only when sshd runs: its PID file is there) is how vmsandbox's boot watcher
# knows when to knock, and bench/fast_start.py where userspace's part of the boot ends.
cat > "$root/etc/systemd/system/vmsandbox-boot.service" <<'UNIT'
[Unit]
Description=vmsandbox: the rest of the boot, once sshd has started
DefaultDependencies=no
After=ssh.service vmsandbox-firstboot.service
Conflicts=shutdown.target
Before=shutdown.target

[Service]
Type=oneshot
RemainAfterExit=yes
StandardOutput=null
ExecStart=/bin/sh -c 'read -r up _ < /proc/uptime; [ ! -s /run/sshd.pid ] || echo "vmsandbox-boot: sshd is up at $${up}s" > /dev/console; exec systemctl start --no-block default.target'
UNIT
# With the kernel's "quiet", systemd reports no unit on the console: this line says when the
# network is configured for guests whose NIC comes up late (its driver loaded by udev, then
# networkd), as the first-boot lines do for the others.
cat > "$root/etc/systemd/system/vmsandbox-online.service" <<'UNIT'
[Unit]
Description=vmsandbox: say on the console that the network is online
Wants=network-online.target
After=network-online.target

[Service]
Type=oneshot
StandardOutput=null
ExecStart=/bin/sh -c 'read -r up _ < /proc/uptime; echo "vmsandbox-boot: network is online at $${up}s" > /dev/console'

[Install]
WantedBy=multi-user.target
UNIT
systemctl --root="$root" --quiet enable vmsandbox-online.service
mkdir -p "$root/etc/systemd/system/systemd-journald.service.d"
printf '[Unit]\nAfter=ssh.service\n' \
  > "$root/etc/systemd/system/systemd-journald.service.d/90-vmsandbox.conf"
# Logins: systemd makes /run/nologin at boot (pam_nologin then refuses every user but root) and
# removes it only after network.target (systemd-user-sessions.service). Here sshd starts once
# the guest is set up for its user, so the file is not made.
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
# updates, systemd.run= on the kernel command line, /etc/rc.local (the image has none), and
# gettys for the kernel's consoles (the serial one is enabled by name). The fstab and debug
# (systemd.mask= on the kernel command line) generators stay. Also off: networkd units made from ip= on
# the kernel command line (never given), and the module list of /etc/modules (empty here;
# modules-load.d files a guest setup adds still load).
mkdir -p "$root/etc/systemd/system-generators"
for generator in systemd-sysv-generator systemd-cryptsetup-generator systemd-veritysetup-generator \
                 systemd-integritysetup-generator systemd-gpt-auto-generator \
                 systemd-hibernate-resume-generator systemd-system-update-generator \
                 systemd-run-generator systemd-rc-local-generator systemd-getty-generator; do
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
# 280 here, over a second of the vCPU), after sshd like the rest of udev, and only for what a
# sandbox uses: PCI (the drivers of passed devices: GPUs), virtio (the control channel's port,
# the entropy source, a NIC left to udev), network links (networkd manages a link once udev has
# seen it), disks, input (the power button that a graceful stop presses, which logind watches),
# misc (/dev/kvm, /dev/fuse and the like get their groups and modes), the CPU (the KVM module,
# for nested guests) and the serial console (its login prompt waits for the device). Left out:
# ACPI (49 events; the power button's driver is loaded by name instead), virtual consoles and
# ttys nobody uses, and bookkeeping classes no rule acts on (memory blocks, wakeup sources,
# PCIe port services, workqueues, LEDs). Devices added later are seen as they come.
mkdir -p "$root/etc/systemd/system/systemd-udev-trigger.service.d"
cat > "$root/etc/systemd/system/systemd-udev-trigger.service.d/90-vmsandbox.conf" <<'UNIT'
[Service]
ExecStart=
ExecStart=-udevadm trigger --type=devices --action=add --subsystem-match=pci --subsystem-match=virtio --subsystem-match=net --subsystem-match=block --subsystem-match=input --subsystem-match=misc --subsystem-match=cpu
ExecStart=-udevadm trigger --type=devices --action=add --sysname-match=ttyS0
UNIT
mkdir -p "$root/etc/modules-load.d"
printf '# the ACPI power button (a graceful stop), without coldplugging ACPI\nbutton\n' \
  > "$root/etc/modules-load.d/vmsandbox.conf"

# systemd-tmpfiles-setup runs seconds after sshd here, and Debian's rule for /tmp ("D") has it
# empty /tmp at every boot: files a user wrote there in the first seconds after the create were
# deleted. The rule becomes "d" (made if missing, never emptied); /init empties /tmp before
# systemd starts instead.
mkdir -p "$root/etc/tmpfiles.d"
sed 's|^D /tmp |d /tmp |' "$root/usr/lib/tmpfiles.d/tmp.conf" > "$root/etc/tmpfiles.d/tmp.conf"
grep -q '^d /tmp ' "$root/etc/tmpfiles.d/tmp.conf"

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
