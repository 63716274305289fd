#!/bin/sh
# Customisation of the nested GPU host (L1). $1 is the image's root directory. setup/nested.sh
# boots it with a second disk (/dev/vdb) made at each start: SSH keys under ssh/, the image store
# L1's vmsandbox creates L2 guests from under images/.
set -eu
root="$1"

printf '/dev/vda / ext4 defaults,errors=remount-ro 0 1\n/dev/vdb /srv/nested ext4 defaults 0 2\n' \
  > "$root/etc/fstab"
mkdir -p "$root/srv/nested"

# Static address on QEMU's user-mode network: no DHCP wait at boot.
cat > "$root/etc/network/interfaces" <<'NET'
auto lo
iface lo inet loopback
auto eth0
iface eth0 inet static
  address 10.0.2.15/24
  gateway 10.0.2.2
NET
echo nested-gpu-host > "$root/etc/hostname"

# Root logs in with the key of this start only; the host key also comes from the start's disk, so
# setup/nested.sh pins it instead of trusting on first use. None is baked into the image.
rm -f "$root"/etc/ssh/ssh_host_*
mkdir -p "$root/etc/ssh/sshd_config.d"
cat > "$root/etc/ssh/sshd_config.d/90-nested.conf" <<'SSHD'
HostKey /srv/nested/ssh/host_ed25519_key
AuthorizedKeysFile /srv/nested/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
SSHD

# vmsandbox: a venv over Debian's packages, with the PyPI packages Debian lacks or has too old.
# Its own code is copied to /opt/vmsandbox/src at each start (a .pth file puts it on the path).
# The wheels are downloaded on the build host, with its pip configuration (index, proxy, CA
# bundle) as setup.sh's venv was, and installed in the image from that folder only: the image's
# own pip would know none of that (behind a TLS proxy its CA bundle lacks the proxy's CA).
wheels="$root/tmp/vmsandbox-wheels"
python3 -m venv "$wheels/pip"
"$wheels/pip/bin/pip" download --quiet --only-binary=:all: --dest "$wheels" \
  'paramiko>=3.4' 'nvidia-ml-py>=12.535'
chroot "$root" python3 -m venv --system-site-packages /opt/vmsandbox
chroot "$root" /opt/vmsandbox/bin/pip install --isolated --quiet --no-index \
  --find-links /tmp/vmsandbox-wheels 'paramiko>=3.4' 'nvidia-ml-py>=12.535'
rm -rf "$wheels"
mkdir -p "$root/opt/vmsandbox/src"
site=$(chroot "$root" /opt/vmsandbox/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo /opt/vmsandbox/src > "$root/$site/vmsandbox-src.pth"
cat > "$root/usr/local/bin/vmsandbox" <<'BIN'
#!/bin/sh
exec /opt/vmsandbox/bin/python -m vmsandbox.cli "$@"
BIN
chmod 0755 "$root/usr/local/bin/vmsandbox"
mkdir -p "$root/etc/vmsandbox"
printf 'image_dir = "/srv/nested/images"\n' > "$root/etc/vmsandbox/config.toml"

# libvirt's default NAT network is not used (L2 guests get user-mode networking from vmsandbox).
rm -f "$root/etc/libvirt/qemu/networks/autostart/default.xml"

chroot "$root" systemctl enable serial-getty@ttyS0.service >/dev/null 2>&1 || true
: > "$root/etc/machine-id"
rm -f "$root/var/lib/dbus/machine-id"
rm -rf "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/var/lib/apt/lists/* \
       "$root"/var/cache/apt/*.bin "$root"/root/.cache
