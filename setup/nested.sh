#!/usr/bin/env bash
# The nested GPU host: an L1 guest with an emulated Intel IOMMU and two emulated ati-vga cards, in
# which vmsandbox's GPU path runs on real VFIO (docs: "The nested GPU host").
#
#   setup/nested.sh prepare           build the images if needed and save the pristine snapshot
#                                     if there is no current one (a cold boot of L1), then stop L1
#   setup/nested.sh start             build the images if needed, boot L1 (or reuse the running
#                                     one), copy this checkout's vmsandbox in, wait for
#                                     `vmsandbox gpus` to answer inside; the first boot also
#                                     saves L1 as it is then (the pristine snapshot)
#   setup/nested.sh exec -- CMD...    run CMD as root inside, vmsandbox on PATH; stdout, stderr
#                                     and the exit status pass through
#   setup/nested.sh restart           throw the running L1 away and start a pristine one from
#                                     the snapshot (about 5 s; a cold boot when there is none)
#   setup/nested.sh kill              stop L1's QEMU at once (a sick L1), keep the snapshot
#   setup/nested.sh stop              power L1 off and remove what start made (not the images)
#
# Environment: PYTHON (default .venv/bin/python) runs vmsandbox here for the image builds;
# VMSANDBOX_NESTED_DIR (default /var/tmp/vmsandbox-nested) holds the running host's files;
# VMSANDBOX_NESTED_CPUS (default 1), VMSANDBOX_NESTED_MEMORY_MIB (default 3072),
# VMSANDBOX_NESTED_CPU (default EPYC), VMSANDBOX_NESTED_TCG_THREAD (multi or single, default
# multi), VMSANDBOX_NESTED_CARDS (mixed or twin, default mixed: see CARDS) and
# VMSANDBOX_NESTED_BOOT_TIMEOUT (default 900 s). L1 is a plain QEMU process under TCG
# in a session of its own; its SSH is forwarded to 127.0.0.1 only, its monitor is a UNIX socket
# in VMSANDBOX_NESTED_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
STATE="${VMSANDBOX_NESTED_DIR:-/var/tmp/vmsandbox-nested}"
MEMORY_MIB="${VMSANDBOX_NESTED_MEMORY_MIB:-3072}"
# One vCPU: with two, an L1 running an L2 under KVM was lost in about one pool boot of four
# (an RCU stall of the idle vCPU, a silent hang, a crawl); with one, none was in the runs that
# docs/nested-gpu-host.md lists under "What was tried". The L2 boots about 15% slower.
CPUS="${VMSANDBOX_NESTED_CPUS:-1}"
BOOT_TIMEOUT="${VMSANDBOX_NESTED_BOOT_TIMEOUT:-900}"
# L1 runs kvm_amd on its emulated SVM, so L2 guests run under KVM inside it (minutes faster than
# TCG inside TCG, which never reached SSH in 16 min here). Not with OVMF in L2: the outer QEMU
# (7.2, and 10.0.2 from bookworm-backports) then aborts L1 with "tcg_handle_interrupt: assertion
# failed: (bql_locked())" -- its SVM CR8-write helper raises the nested guest's interrupt without
# the big QEMU lock. The emulated cards' BARs are small, so vmsandbox boots their guests with
# SeaBIOS (gpu_firmware "auto", passthrough.choose_firmware) and OVMF never runs in L2.
QEMU=/usr/bin/qemu-system-x86_64
# L1's CPU: an EPYC with SVM and nested paging (TCG drops the features it lacks, with warnings
# in qemu.log). KVM inside TCG is unreliable (docs/nested-gpu-host.md): an L2 boot crawls now
# and then and L1's kernel can overflow a vCPU thread's stack in its exception entry and panic;
# the tests watch L1 and run a step again in a pristine L1 (tests/framework/nested_host.py).
L1_CPU="${VMSANDBOX_NESTED_CPU:-EPYC}"
TCG_THREAD="${VMSANDBOX_NESTED_TCG_THREAD:-multi}"
# The two cards: an RV100 (Radeon 7000, 1002:5159, which radeon drives) and a Rage 128 Pro
# (1002:5046, which no driver of the generic kernel binds by default), each behind a PCIe root
# port of its own: alone in its IOMMU group with its port, and alone below a bridge, so that
# L1's kernel can reset it with a secondary bus reset (reset_method "bus") and every rule of
# vmsandbox holds in L1 as on a GPU host. The ports' ids are what QEMU's monitor names them by
# (fault injection: `pcie_aer_inject_error gpu1 ...`).
# VMSANDBOX_NESTED_CARDS=twin gives two Rage 128 Pros instead: two cards of one model, for a
# suspended sandbox resumed onto the other card (give it a VMSANDBOX_NESTED_DIR of its own).
CARD_SET="${VMSANDBOX_NESTED_CARDS:-mixed}"
case "$CARD_SET" in
  mixed) FIRST_MODEL=rv100 ;;
  twin) FIRST_MODEL=rage128p ;;
  *) echo "[nested] VMSANDBOX_NESTED_CARDS is '$CARD_SET': mixed or twin" >&2; exit 2 ;;
esac
CARDS=(
  -device pcie-root-port,id=gpu0,bus=pcie.0,addr=0x5,chassis=5 -device "ati-vga,model=$FIRST_MODEL,bus=gpu0"
  -device pcie-root-port,id=gpu1,bus=pcie.0,addr=0x6,chassis=6 -device ati-vga,model=rage128p,bus=gpu1
)
# L1's scrub hook: the cards keep their video memory through a reset, so vmsandbox's sanitize
# zeroes it through BAR0 (setup/scrub_bar.py, copied in with the code).
SCRUB_HOOK=/opt/vmsandbox/src/setup/scrub_bar.py

say() { printf '[nested] %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

running() { [ -f "$STATE/qemu.pid" ] && kill -0 "$(cat "$STATE/qemu.pid")" 2>/dev/null; }

# Commands share one SSH connection to L1 (a handshake under TCG costs a second or two). Its
# master is started apart, with no file of the caller's open (a caller reading our output to its
# end would wait for the master otherwise), and ends with L1 or after a minute unused.
ssh_l1() {
  local opts=(
    -q -p "$(cat "$STATE/port")" -i "$STATE/id_ed25519"
    -o UserKnownHostsFile="$STATE/known_hosts" -o StrictHostKeyChecking=yes
    -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=15 -o ServerAliveCountMax=4
    -o ControlPath="$STATE/ssh-mux" -o LogLevel=ERROR
  )
  [ -S "$STATE/ssh-mux" ] || flock "$STATE/ssh-mux.lock" sh -c '[ -S "$0" ] || exec "$@"' \
    "$STATE/ssh-mux" ssh "${opts[@]}" -o ControlMaster=yes -o ControlPersist=60 -fN \
    root@127.0.0.1 </dev/null >/dev/null 2>&1 || true
  ssh "${opts[@]}" -o ControlMaster=no -T root@127.0.0.1 "$@"
}

# Absolute build folder of image $1 in the host's image store (the current build).
image_path() {
  "$PYTHON" -m vmsandbox.cli images list --json | "$PYTHON" -c '
import json, sys
found = [i["path"] for i in json.load(sys.stdin)["images"] if i["name"] == sys.argv[1]]
print(found[0] if found else "")' "$1"
}

# Free TCP port on 127.0.0.1 for L1's SSH.
free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The disk L1 mounts at /srv/nested: this start's SSH keys and the host's minimal image, whose
# build folder becomes L1's image store (vmsandbox in L1 creates L2 guests from it).
make_data_disk() {
  local minimal="$1" stage="$STATE/data"
  rm -rf "$stage"
  mkdir -p "$stage/ssh" "$stage/images/minimal"
  chmod 0755 "$stage" "$stage/images" "$stage/images/minimal"  # the filesystem's root takes these
  chmod 0700 "$stage/ssh"
  cp "$STATE/host_ed25519_key" "$stage/ssh/host_ed25519_key"
  cp "$STATE/id_ed25519.pub" "$stage/ssh/authorized_keys"
  chmod 0600 "$stage/ssh/"*
  # hard links where the store shares a filesystem with $STATE, copies where not
  cp -al "$minimal" "$stage/images/minimal/" 2>/dev/null || cp -a "$minimal" "$stage/images/minimal/"
  ln -s "$(basename "$minimal")" "$stage/images/minimal/current"
  local used_mib
  used_mib=$(du -sm "$stage" | cut -f1)
  mkfs.ext4 -q -F -L nested -d "$stage" "$STATE/data.img" "$((used_mib * 12 / 10 + 256))M" >&2
  rm -rf "$stage"
}

# The checkout's package, the templates it reads from beside it and the tests' crash entry
# point (tests/framework/crash_cli.py, for the kill-at-each-stage tests), replacing the last copy.
sync_code() {
  tar -C "$PWD" --exclude=__pycache__ -cf - vmsandbox templates tests/framework/crash_cli.py \
    setup/scrub_bar.py \
    | ssh_l1 'cd /opt/vmsandbox/src && rm -rf vmsandbox templates tests setup && tar -xf -'
  ssh_l1 "grep -q '^gpu_scrub_hook' /etc/vmsandbox/config.toml \
    || printf 'gpu_scrub_hook = \"%s\"\\n' $SCRUB_HOOK >> /etc/vmsandbox/config.toml"
}

# Wait until CMD... succeeds in L1 (L1 must stay up, within the boot timeout); its last output
# goes to stdout.
wait_for() {
  local deadline=$((SECONDS + BOOT_TIMEOUT)) out
  until out=$(ssh_l1 "$@" 2>/dev/null); do
    running || { tail -n 40 "$STATE/console.log" "$STATE/qemu.log" >&2 || true; die "L1 exited (console and QEMU log above)"; }
    [ "$SECONDS" -lt "$deadline" ] || {
      tail -n 40 "$STATE/console.log" >&2 || true
      die "'$*' did not succeed in L1 within ${BOOT_TIMEOUT}s (console above)"
    }
    sleep 1
  done
  [ -z "$out" ] || printf '%s\n' "$out"
}

# L1's QEMU command line. Its disks are thin overlays under $STATE/run, over the images at a cold
# boot and over the snapshot's disks after a restore; the rest is the same both ways, as loading a
# saved state needs.
qemu_args() {
  local nested
  nested=$(cat "$STATE/image")
  QEMU_ARGS=(
    "$QEMU" -name vmsandbox-nested -nodefaults -machine q35 -accel "tcg,thread=$TCG_THREAD"
    -cpu "$L1_CPU" -smp "$CPUS" -m "$MEMORY_MIB"
    -device intel-iommu,intremap=on,caching-mode=on
    -vga std "${CARDS[@]}"
    -kernel "$nested/vmlinuz" -initrd "$nested/initrd.img"
    -append "root=/dev/vda rw console=ttyS0,115200 net.ifnames=0 intel_iommu=on"
    -drive "file=$STATE/run/l1.qcow2,if=virtio,format=qcow2"
    -drive "file=$STATE/run/data.qcow2,if=virtio,format=qcow2"
    -netdev "user,id=n0,hostfwd=tcp:127.0.0.1:$(cat "$STATE/port")-:22"
    -device virtio-net-pci,netdev=n0 -device virtio-rng-pci
    -display none -serial "file:$STATE/console.log" -pidfile "$STATE/qemu.pid"
    -qmp "unix:$STATE/qmp.sock,server=on,wait=off"
  )
}

# Start L1's QEMU with the extra arguments given, in a session of its own so it outlives this
# script (its errors stay in qemu.log).
launch() {
  qemu_args
  rm -f "$STATE/qemu.pid" "$STATE/qmp.sock"
  setsid "${QEMU_ARGS[@]}" "$@" </dev/null >"$STATE/qemu.log" 2>&1 9>&- &  # not start's lock
  disown  # its end is no job of this shell's to report
  for _ in $(seq 1 100); do [ -s "$STATE/qemu.pid" ] && [ -S "$STATE/qmp.sock" ] && break; sleep 0.1; done
  running || { cat "$STATE/qemu.log" >&2; die "QEMU did not start (its log above)"; }
}

# Kill L1's QEMU, if one runs, and wait until it is gone.
kill_l1() {
  running || return 0
  local pid
  pid=$(cat "$STATE/qemu.pid")
  kill -9 "$pid" 2>/dev/null || true  # nothing of a thrown-away L1 is kept
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  ssh -q -o ControlPath="$STATE/ssh-mux" -O exit root@127.0.0.1 2>/dev/null || true
  rm -f "$STATE/ssh-mux" "$STATE/ssh-mux.lock"
}

boot() {
  [ "$(id -u)" = 0 ] || die "run as root (the image builds write /var/lib/vmsandbox)"
  say "building the images if needed (minimal, nested)"
  "$PYTHON" -m vmsandbox.cli images build minimal >&2
  "$PYTHON" -m vmsandbox.cli images build nested >&2
  local nested minimal
  nested=$(image_path nested)
  minimal=$(image_path minimal)
  [ -n "$nested" ] && [ -n "$minimal" ] || die "image nested or minimal is missing after the build"

  rm -rf "$STATE"
  mkdir -p "$STATE/run"
  chmod 0700 "$STATE"
  echo "$nested" > "$STATE/image"
  snapshot_key > "$STATE/images"  # what a snapshot of this L1 holds (see `snapshot_current`)
  ssh-keygen -q -t ed25519 -N '' -C vmsandbox-nested -f "$STATE/id_ed25519"
  ssh-keygen -q -t ed25519 -N '' -C vmsandbox-nested-host -f "$STATE/host_ed25519_key"
  free_port > "$STATE/port"
  printf '[127.0.0.1]:%s %s\n' "$(cat "$STATE/port")" "$(cut -d' ' -f1,2 "$STATE/host_ed25519_key.pub")" \
    > "$STATE/known_hosts"
  say "making L1's disks in $STATE"
  make_data_disk "$minimal"
  qemu-img create -q -f qcow2 -F qcow2 -b "$nested/disk.qcow2" "$STATE/run/l1.qcow2" 8G
  qemu-img create -q -f qcow2 -F raw -b "$STATE/data.img" "$STATE/run/data.qcow2"

  say "booting L1 (TCG, $CPUS vCPU(s), ${MEMORY_MIB} MiB, SSH on 127.0.0.1:$(cat "$STATE/port"))"
  launch
}

# The cards' PCI functions in L1 (behind the root ports CARDS makes, on the buses SeaBIOS gives
# them).
CARD_BDFS="0000:01:00.0 0000:02:00.0"

# Save the freshly booted L1 (no L2 guest started yet) as the pristine snapshot: its memory and
# device state in snap/state, its disks as they are then in snap/. The emulated cards have no
# saved state in QEMU (a restored card comes back as at power-on), so L1 lets go of them first and
# finds them again after each restore (see `restore`). L1 then runs on from the snapshot.
snapshot() {
  say "saving L1 as the pristine snapshot"
  # vmsandbox's KVM probe (a few seconds of an L2 kernel under KVM) runs here once; restored
  # L1s find its answer cached and start KVM only for the L2 guests the tests boot.
  ssh_l1 /opt/vmsandbox/bin/python -c "'from vmsandbox.config import Config; from vmsandbox.image.store import ImageStore; from vmsandbox.vm import virt; c = Config.load(); virt.for_sandbox(\"auto\", c, ImageStore(c.images).get(\"minimal\").kernel, print)'" >&2
  ssh_l1 "for d in $CARD_BDFS; do echo 1 > /sys/bus/pci/devices/\$d/remove; done; sync"
  mkdir -p "$STATE/snap"
  "$PYTHON" setup/qmp.py "$STATE/qmp.sock" save "$STATE/snap/state"
  kill_l1
  mv "$STATE/run/l1.qcow2" "$STATE/run/data.qcow2" "$STATE/snap/"
  restore
}

# Start L1 from the pristine snapshot on fresh overlays: as it was when saved, plus the host's
# clock and the cards found again (the kernel assigns their BARs, radeon probes its card anew).
restore() {
  kill_l1
  rm -f "$STATE/run/"*.qcow2
  qemu-img create -q -f qcow2 -F qcow2 -b "$STATE/snap/l1.qcow2" "$STATE/run/l1.qcow2"
  qemu-img create -q -f qcow2 -F qcow2 -b "$STATE/snap/data.qcow2" "$STATE/run/data.qcow2"
  launch -incoming "exec:cat $STATE/snap/state"
  "$PYTHON" setup/qmp.py "$STATE/qmp.sock" resume 120
  wait_for true
  ssh_l1 "date -s @$(date +%s.%N) >/dev/null && echo 1 > /sys/bus/pci/rescan"
}

# What a snapshot holds: the nested and minimal images, and the machine it was saved from (QEMU
# loads a saved state only into the same CPU model, vCPU count, memory size and devices).
snapshot_key() {
  local cards
  cards=$(printf '%s ' "${CARDS[@]}" | md5sum | cut -c1-12)
  echo "$(image_path nested) $(image_path minimal) cpu=$L1_CPU cpus=$CPUS memory=$MEMORY_MIB cards=$cards"
}

# Whether the pristine snapshot is there and was saved from the current images and machine.
snapshot_current() {
  [ -f "$STATE/snap/state" ] && [ "$(cat "$STATE/images" 2>/dev/null)" = "$(snapshot_key)" ]
}

# The snapshot made ready for later starts (the images built, L1 booted cold and saved when
# there is no current snapshot), with no L1 left running.
cmd_prepare() {
  if snapshot_current; then
    say "L1's pristine snapshot is current"
    return 0
  fi
  kill_l1
  cmd_start
  kill_l1
  say "L1's pristine snapshot is saved; L1 is stopped"
}

cmd_start() {
  mkdir -p "$(dirname "$STATE")"
  exec 9>"$STATE.lock"
  flock 9
  local started=$SECONDS
  if running && ssh_l1 true 2>/dev/null; then
    say "reusing the running L1 (pid $(cat "$STATE/qemu.pid"))"
  elif snapshot_current; then
    say "starting a pristine L1 from the snapshot"
    restore
  else
    [ ! -f "$STATE/snap/state" ] \
      || say "the images or L1's machine changed since its snapshot was saved: booting L1 cold"
    kill_l1
    boot
  fi
  wait_for true
  say "copying vmsandbox from $PWD into L1"
  sync_code
  if [ ! -f "$STATE/snap/state" ]; then
    wait_for vmsandbox gpus >/dev/null
    snapshot
  fi
  wait_for vmsandbox gpus
  say "L1 ready in $((SECONDS - started)) s"
}

cmd_exec() {
  [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || die "usage: setup/nested.sh exec -- CMD..."
  running || die "no nested host runs; run setup/nested.sh start"
  local quoted
  quoted=$(printf '%q ' "$@")
  local rc=0
  # Every rule of vmsandbox is on in L1: the cards reset with a secondary bus reset of their
  # root ports, and L1's config names the scrub hook that clears their memory.
  ssh_l1 "export PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin; $quoted" \
    || rc=$?
  if [ "$rc" = 255 ] && grep -a -q "Kernel panic" "$STATE/console.log"; then
    # ssh itself failed and L1's kernel panicked (KVM inside TCG; docs/nested-gpu-host.md): its last
    # console lines hold the trace.
    tail -n 60 "$STATE/console.log" | sed 's/^/[nested] L1: /' >&2
  fi
  return "$rc"
}

cmd_stop() {
  if running; then say "powering L1 off (pid $(cat "$STATE/qemu.pid"))"; fi
  kill_l1
  rm -rf "$STATE" "$STATE.lock"
}

case "${1:-}" in
  prepare) cmd_prepare ;;
  start) cmd_start ;;
  exec) shift; cmd_exec "$@" ;;
  restart) kill_l1; cmd_start ;;
  kill) kill_l1 ;;
  stop) cmd_stop ;;
  *) die "usage: setup/nested.sh prepare | start | exec -- CMD... | restart | kill | stop" ;;
esac
