#!/bin/sh
# Make sure the NVIDIA kernel modules are built for every kernel of the image whose headers are
# installed, and fail the build otherwise. $1 is the image's root directory (mmdebstrap customize
# hook, run on the build host). DKMS in a chroot builds for the kernels under /lib/modules, not
# for the host's running kernel; this hook runs `dkms autoinstall` for any it missed.
#
# Debian installs the modules as nvidia-current.ko, nvidia-current-uvm.ko, ...; `nvidia` and
# `nvidia-uvm` are install rules in /etc/modprobe.d/nvidia.conf, which modprobe follows and
# modinfo does not, so the checks below name the files.
set -eu
root="$1"

found=0
for dir in "$root"/lib/modules/*/; do
  version=$(basename "$dir")
  # build is an absolute link into /usr/src: follow it inside the image, not on the host
  chroot "$root" test -d "/lib/modules/$version/build/" || continue
  found=1
  if ! chroot "$root" modinfo -k "$version" -F vermagic nvidia-current >/dev/null 2>&1; then
    echo "I: nvidia module missing for $version; running dkms autoinstall"
    chroot "$root" dkms autoinstall -k "$version"
  fi
  chroot "$root" dkms status -k "$version" | sed 's/^/I: dkms: /'
  for module in nvidia-current nvidia-current-uvm; do
    vermagic=$(chroot "$root" modinfo -k "$version" -F vermagic "$module" 2>/dev/null || true)
    case "$vermagic" in
      "$version "*) echo "I: $module built for $version" ;;
      *)
        echo "E: $module is not built for kernel $version (vermagic: '${vermagic:-none}')" >&2
        exit 1
        ;;
    esac
  done
done
if [ "$found" = 0 ]; then
  echo "E: no kernel headers in the image: DKMS cannot build the NVIDIA module" >&2
  exit 1
fi
