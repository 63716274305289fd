#!/bin/sh
# vmsandbox's control channel in the guest (issue 15). $1 is the image's root directory.
# The recipe installs /usr/lib/vmsandbox/control.py (guest_tools); this script adds its unit.
# A pool claim sets the hostname through it instead of an SSH login and sudo; the image's
# meta.json lists control.py, so vmsandbox gives its domains the channel's port.
set -eu
root="$1"

# Root, as the claim's sudo was; it starts once sshd has, off the way to SSH, and waits (without
# spinning) for the host to open the port.
# Real-time (SCHED_FIFO, the lowest priority, below the kernel's interrupt threads), so that a
# request is served before anything else in the guest: a resume's wake is answered as soon as
# the restored guest has set its clock and seed, instead of sharing the single vCPU in 4 ms
# slices with what the restore woke (a clock jump wakes systemd, dbus and logind; the guest's
# own processes). Under TCG the wake took 0.25-0.3 s of which the program ran 70 ms; it then
# took 0.06-0.12 s. The program blocks between requests and runs milliseconds per request;
# were it ever to spin, the kernel's real-time throttling (sched_rt_runtime_us) still leaves
# the rest of the guest 5% of each second. It starts no program; one it started would not be
# real-time (reset on fork).
cat > "$root/etc/systemd/system/vmsandbox-control.service" <<'UNIT'
[Unit]
Description=vmsandbox control channel (org.vmsandbox.control.0)
After=ssh.service

[Service]
ExecStart=/usr/bin/python3 -I -S /usr/lib/vmsandbox/control.pyc
CPUSchedulingPolicy=fifo
CPUSchedulingPriority=1
CPUSchedulingResetOnFork=yes
Restart=on-failure
StandardOutput=journal+console
StandardError=journal+console
NoNewPrivileges=yes
PrivateTmp=yes
ProtectHome=yes

[Install]
WantedBy=multi-user.target
UNIT

chroot "$root" python3 -c 'import py_compile, sys; py_compile.compile(sys.argv[1], \
  cfile=sys.argv[1] + "c", doraise=True)' /usr/lib/vmsandbox/control.py
systemctl --root="$root" --quiet enable vmsandbox-control.service
