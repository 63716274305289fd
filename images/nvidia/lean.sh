#!/bin/sh
# The NVIDIA image's part of the lean boot, after images/common/lean.sh. $1 is the image's root
# directory. The driver loads when a GPU is there, and only then.
set -eu
root="$1"

# Debian's driver packages load nvidia-drm at every boot (/etc/modules-load.d/nvidia.conf, an
# alternatives link), and nvidia-modeset and nvidia with it. In the cloud kernel nvidia-drm is an
# empty stub (no DRM) and nvidia-modeset drives displays, which a sandbox has not; nvidia itself
# is loaded by udev for the GPU's PCI device (its modalias; PCI is coldplugged) and nvidia-uvm by
# libcuda (nvidia-modprobe). Loading them at boot in a guest without a GPU took 11 s of the single
# vCPU under TCG, failing twice ("NVRM: No NVIDIA GPU found"), before sshd. The link becomes a
# plain file, which update-alternatives leaves alone on upgrades.
load="$root/etc/modules-load.d/nvidia.conf"
# Whatever the packages put there (other releases may list other modules), none is loaded.
echo "I: modules at boot were: $(chroot "$root" cat /etc/modules-load.d/nvidia.conf 2>/dev/null \
  | grep -v '^#' | tr '\n' ' ')"
rm -f "$load"
cat > "$load" <<'CONF'
# No NVIDIA module at boot in vmsandbox's image (images/nvidia/lean.sh): udev loads nvidia for
# each NVIDIA GPU and libcuda loads nvidia-uvm; nvidia-drm has no DRM to serve in the cloud kernel.
CONF

# The persistence daemon keeps each GPU initialised between clients (without it every
# nvidia-smi or CUDA start sets a GPU up again). Enabled at boot it fails in a guest without a
# GPU (a pooled guest boots without one), leaves the system "degraded" and never runs for the
# GPU that a pool claim attaches later. Here udev starts it when an NVIDIA display-class PCI
# device is added: at boot (PCI is coldplugged) or attached live. It loads the driver and makes
# the /dev/nvidia* nodes itself (nvidia-modprobe).
systemctl --root="$root" --quiet disable nvidia-persistenced.service
mkdir -p "$root/etc/udev/rules.d"
cat > "$root/etc/udev/rules.d/71-vmsandbox-nvidia-persistenced.rules" <<'RULES'
# vmsandbox: the NVIDIA persistence daemon runs once an NVIDIA GPU is there (images/nvidia/lean.sh).
ACTION=="add", SUBSYSTEM=="pci", ATTR{vendor}=="0x10de", ATTR{class}=="0x03*", TAG+="systemd", ENV{SYSTEMD_WANTS}+="nvidia-persistenced.service"
RULES
