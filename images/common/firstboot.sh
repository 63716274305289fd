#!/bin/sh
# vmsandbox's own first boot, in place of cloud-init (issue 15). $1 is the image's root directory.
# The recipe installs /usr/lib/vmsandbox/firstboot.py and its modules firstboot_seed.py and
# firstboot_iso.py (guest_tools); this script adds its units.
# It reads the same NoCloud seed vmsandbox writes for every image (stock cloud images read it
# with their own cloud-init), so a recipe using it leaves the cloud-init package out.
set -eu
root="$1"
units="$root/etc/systemd/system"

# Before the network and sshd: hostname, user and key, host key, network, the guest setup's
# files. Its lines go to the console, where vmsandbox's boot watcher reads them. The network is
# systemd-networkd's (part of systemd; the recipes leave ifupdown out), configured by this unit.
# It is the way to sshd, so it starts as soon as the root filesystem has its fstab options
# (the kernel mounts it read-write) and, while the guest boots, gets ten times the CPU share of
# any other unit, which share the single vCPU with it (a CPU weight: with the cgroup CPU
# controller on, a nice value counts only inside the unit).
cat > "$units/vmsandbox-firstboot.service" <<'UNIT'
[Unit]
Description=vmsandbox first boot from the NoCloud seed
DefaultDependencies=no
After=systemd-remount-fs.service
Before=systemd-networkd.service ssh.service systemd-user-sessions.service shutdown.target
Conflicts=shutdown.target

[Service]
Type=oneshot
RemainAfterExit=yes
StartupCPUWeight=1000
ExecStart=/usr/bin/python3 -I -S /usr/lib/vmsandbox/firstboot.pyc
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=sysinit.target
UNIT

# The seed's runcmd (the guest setup's units started), beside sshd as cloud-init's late stages
# ran it: once, when the first-boot unit left commands to run. It pulls in network-online.target
# at every boot, whose line on the console tells vmsandbox's SSH wait that the network is up.
cat > "$units/vmsandbox-runcmd.service" <<'UNIT'
[Unit]
Description=vmsandbox first boot: the NoCloud seed's runcmd
After=vmsandbox-firstboot.service network-online.target
Wants=network-online.target
ConditionPathExists=/var/lib/vmsandbox/runcmd.json

[Service]
Type=oneshot
ExecStart=/usr/bin/python3 -I -S /usr/lib/vmsandbox/firstboot.pyc --runcmd
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
UNIT

# The root filesystem grows to the overlay's size before sshd starts, so that a sandbox answers
# SSH with its whole disk: a job started as soon as create returns (a gateway's normal path)
# must not find the image's few hundred MiB free. It starts as soon as the root is writable and
# runs beside the rest of the way to sshd (its time is mostly the host writing the overlay),
# once: a sandbox's disk never changes size.
cat > "$units/vmsandbox-growfs.service" <<'UNIT'
[Unit]
Description=vmsandbox: grow the root filesystem to its disk, before sshd
DefaultDependencies=no
After=systemd-remount-fs.service
Before=ssh.service vmsandbox-boot.service shutdown.target
Conflicts=shutdown.target
ConditionPathExists=!/var/lib/vmsandbox/rootfs-grown

[Service]
Type=oneshot
RemainAfterExit=yes
TimeoutStartSec=300
ExecStart=/bin/sh -c 'resize2fs "$(findmnt -no SOURCE /)" && mkdir -p /var/lib/vmsandbox && : > /var/lib/vmsandbox/rootfs-grown'

[Install]
WantedBy=sysinit.target
UNIT

# Compiled here, once: run as a script, the program would be compiled again at every boot. Its
# modules are compiled where their imports look (__pycache__ beside them).
chroot "$root" python3 -c 'import py_compile, sys
py_compile.compile(sys.argv[1], cfile=sys.argv[1] + "c", doraise=True)
for module in sys.argv[2:]:
    py_compile.compile(module, doraise=True)' /usr/lib/vmsandbox/firstboot.py \
  /usr/lib/vmsandbox/firstboot_seed.py /usr/lib/vmsandbox/firstboot_iso.py

systemctl --root="$root" --quiet enable systemd-networkd.service vmsandbox-firstboot.service \
  vmsandbox-runcmd.service vmsandbox-growfs.service

# systemd-resolved is there for DHCP networks only (the first boot turns it on for them): off,
# and resolv.conf a plain file, until then.
systemctl --root="$root" --quiet disable systemd-resolved.service
rm -f "$root/etc/resolv.conf"
: > "$root/etc/resolv.conf"
