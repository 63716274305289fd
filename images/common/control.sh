#!/bin/sh
# vmsandbox's control channel in the guest (issue 15). $1 is the image's root directory.
# The recipe installs /usr/lib/vmsandbox/control.py (guest_tools); this script adds its unit.
# A pool claim sets the hostname through it instead of an SSH login and sudo; the image's
# meta.json lists control.py, so vmsandbox gives its domains the channel's port.
set -eu
root="$1"

# Root, as the claim's sudo was; it starts once sshd has, off the way to SSH, and waits (without
# spinning) for the host to open the port.
cat > "$root/etc/systemd/system/vmsandbox-control.service" <<'UNIT'
[Unit]
Description=vmsandbox control channel (org.vmsandbox.control.0)
After=ssh.service

[Service]
ExecStart=/usr/bin/python3 -I -S /usr/lib/vmsandbox/control.pyc
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
