#!/bin/sh
# vmsandbox's first boot without an interpreter: applies the plain-text file `vmsandbox-firstboot`
# that vmsandbox adds to the NoCloud seed of a sandbox needing no guest setup (no files, no
# commands, a static NIC). The minimal image's initramfs runs it with busybox before systemd
# starts (images/minimal/lean.sh); seeds without the file are left to the Python unit
# (firstboot.py), which applies the same values from the seed's JSON files.
#
# Usage: firstboot_lean.sh SEED ROOT DEVICE
#   SEED  the folder where the seed is mounted; ROOT  the guest's root filesystem; DEVICE  the
#   seed's block device (named on the console).
# It gives the guest its hostname, the pinned SSH host key, the sandbox user (made as useradd
# makes it: next free uid, its own group, locked password, a home from /etc/skel, subordinate
# ids), its authorized key and sudo rule, systemd-networkd's files for the NIC, and brings the
# NIC up at every boot. Once per instance-id, as the Python unit does.
# Exit status: 0 applied (or applied at an earlier boot of this instance); 3 the seed has no file
# in a format this script reads (the Python unit applies it); 1 failed, after a line
# "vmsandbox-firstboot: error: ..." (vmsandbox's boot watcher fails the create on it).
set -u
PREFIX=vmsandbox-firstboot
FORMAT=1
SYS_NET=/sys/class/net
seed=$1
root=$2
device=$3
file=$seed/vmsandbox-firstboot

say() { echo "$PREFIX: $*"; }
fail() {
  say "error: $*"
  exit 1
}

# put MODE OWNER PATH: standard input into PATH, made by its owner alone first (never through a
# link left at PATH), then given its owner and mode.
put() {
  rm -f "$3" && (umask 077 && cat > "$3") && chown "$2" "$3" && chmod "$1" "$3" \
    || fail "cannot write $3"
}

# The file: a first line "format 1", then one "key value" per line.
[ -f "$file" ] || exit 3
iid='' host='' user='' shell='' sudo='' keys='' hostkeys='' nic=''
number=0
while IFS= read -r line || [ -n "$line" ]; do
  number=$((number + 1))
  key=${line%% *}
  value=${line#"$key"}
  value=${value# }
  case $number:$key in
    1:format)
      if [ "$value" != "$FORMAT" ]; then
        say "note: seed format '$value' is not $FORMAT: left to the first-boot unit"
        exit 3
      fi
      ;;
    1:*) exit 3 ;;
    *:instance-id) iid=$value ;;
    *:hostname) host=$value ;;
    *:user)
      user=${value%% *}
      shell=${value#"$user"}
      shell=${shell# }
      ;;
    *:sudo) sudo=$value ;;
    *:authorized-key) keys="$keys$value
" ;;
    *:host-key) hostkeys="$hostkeys$value
" ;;
    *:nic) nic=$value ;;
    *) fail "$file line $number: '$key' is not understood" ;;
  esac
done < "$file"
say "reading the NoCloud seed on $device"

# Every value is checked before anything is changed.
[ -n "$iid" ] || fail "$file has no instance-id"
case $host in '' | [.-]* | *[!A-Za-z0-9.-]*) fail "$file hostname '$host' is not a host name" ;; esac
case $user in '' | [0-9-]* | *[!a-z0-9_-]*) fail "$file user '$user' is not a user name" ;; esac
case $shell in *:* | [!/]* | '') fail "$file user shell '$shell' is not an absolute path" ;; esac
[ -n "$keys" ] || fail "$file has no authorized-key"
printf %s "$hostkeys" | while read -r name _data; do
  case $name in
    ssh_host_rsa_key | ssh_host_ecdsa_key | ssh_host_ed25519_key) ;;
    ssh_host_rsa_key.pub | ssh_host_ecdsa_key.pub | ssh_host_ed25519_key.pub) ;;
    *) fail "$file host-key '$name' is not an SSH host key file" ;;
  esac
done || exit 1
set -f
# shellcheck disable=SC2086 # the NIC's fields, split on purpose
set -- $nic
set +f
[ $# -ge 4 ] || fail "$file nic '$nic' must be: MAC NAME ADDRESS/PREFIX GATEWAY [DNS...]"
mac=$1 name=$2 address=$3 gateway=$4
shift 4
servers=$*
case $mac in *[!0-9a-f:]* | '') fail "$file nic MAC '$mac' is not a lowercase MAC address" ;; esac
case $name in '' | *[!a-z0-9]*) fail "$file nic name '$name' is not an interface name" ;; esac
for ip in "${address%/*}" "$gateway" $servers; do
  case $ip in '' | *[!0-9.]*) fail "$file nic address '$ip' is not an IPv4 address" ;; esac
done
case ${address#*/} in "$address" | '' | *[!0-9]*) fail "$file nic address '$address' has no prefix length" ;; esac

# login.defs value $1 (default $2) of the guest.
defs() {
  awk -v key="$1" -v value="$2" '$1 == key { value = $2 } END { print value }' \
    "$root/etc/login.defs"
}

# One above the highest id (field 3) of FILE within MIN..MAX, or MIN when none is.
next_id() {
  awk -F: -v min="$2" -v max="$3" \
    '$3 >= min && $3 <= max && $3 >= n { n = $3 + 1 } END { print (n ? n : min) }' "$1"
}

# useradd --create-home --user-group --shell SHELL USER, as Debian's shadow makes it.
add_user() {
  etc=$root/etc
  uid=$(next_id "$etc/passwd" "$(defs UID_MIN 1000)" "$(defs UID_MAX 60000)")
  gid=$uid
  if awk -F: -v gid="$gid" '$3 == gid { found = 1 } END { exit !found }' "$etc/group"; then
    gid=$(next_id "$etc/group" "$(defs GID_MIN 1000)" "$(defs GID_MAX 60000)")
  fi
  days=$(($(date +%s) / 86400))
  {
    echo "$user:x:$uid:$gid::/home/$user:$shell" >> "$etc/passwd" \
      && echo "$user:x:$gid:" >> "$etc/group" \
      && echo "$user:!:$days:$(defs PASS_MIN_DAYS 0):$(defs PASS_MAX_DAYS 99999):$(defs PASS_WARN_AGE 7):::" \
        >> "$etc/shadow" \
      && { [ ! -f "$etc/gshadow" ] || echo "$user:!::" >> "$etc/gshadow"; }
  } || fail "cannot add user $user to $etc"
  for kind in UID GID; do
    case $kind in UID) ids=$etc/subuid ;; *) ids=$etc/subgid ;; esac
    count=$(defs "SUB_${kind}_COUNT" 65536)
    [ -f "$ids" ] && [ "$count" -gt 0 ] || continue
    first=$(awk -F: -v min="$(defs "SUB_${kind}_MIN" 100000)" \
      '$2 + $3 > min { min = $2 + $3 } END { print min }' "$ids")
    echo "$user:$first:$count" >> "$ids" || fail "cannot write $ids"
  done
  home=$root/home/$user
  mkdir -p "$root/home" && mkdir -m 0755 "$home" && cp -a "$etc/skel/." "$home/" \
    && chown -R "$uid:$gid" "$home" || fail "cannot make the home folder $home"
}

apply() {
  echo "$host" > /proc/sys/kernel/hostname || fail "cannot set the hostname $host"
  echo "$host" | put 644 0:0 "$root/etc/hostname"
  printf '127.0.0.1 localhost\n127.0.1.1 %s\n::1 localhost ip6-localhost ip6-loopback\nff02::1 ip6-allnodes\nff02::2 ip6-allrouters\n' \
    "$host" | put 644 0:0 "$root/etc/hosts"

  rm -f "$root"/etc/ssh/ssh_host_*
  printf %s "$hostkeys" | while read -r name data; do
    mode=600
    case $name in *.pub) mode=644 ;; esac
    echo "$data" | base64 -d | put "$mode" 0:0 "$root/etc/ssh/$name"
    [ -s "$root/etc/ssh/$name" ] || fail "host-key $name is not base64 text"
  done || exit 1

  grep -q "^$user:" "$root/etc/passwd" || add_user
  IFS=: read -r _ _ uid gid _ home _ <<EOF
$(grep "^$user:" "$root/etc/passwd")
EOF
  ssh=$root$home/.ssh
  mkdir -p -m 0700 "$ssh" && chown "$uid:$gid" "$ssh" || fail "cannot make $ssh"
  printf %s "$keys" | put 600 "$uid:$gid" "$ssh/authorized_keys"
  if [ -n "$sudo" ]; then
    mkdir -p "$root/etc/sudoers.d"
    echo "$user $sudo" | put 440 0:0 "$root/etc/sudoers.d/90-vmsandbox-users"
  fi

  network=$root/etc/systemd/network
  mkdir -p "$network" || fail "cannot make $network"
  printf '[Match]\nMACAddress=%s\n\n[Link]\nName=%s\n' "$mac" "$name" \
    | put 644 0:0 "$network/50-vmsandbox-$name.link"
  {
    printf '[Match]\nMACAddress=%s\n\n[Network]\nLinkLocalAddressing=no\nIPv6AcceptRA=no\n' "$mac"
    printf 'KeepConfiguration=static\nAddress=%s\nGateway=%s\n' "$address" "$gateway"
    for server in $servers; do echo "DNS=$server"; done
  } | put 644 0:0 "$network/50-vmsandbox-$name.network"
  if [ -n "$servers" ]; then
    for server in $servers; do echo "nameserver $server"; done | put 644 0:0 "$root/etc/resolv.conf"
  fi
}

# The NIC up with its address and gateway, at every boot: sshd answers as soon as it listens.
# A NIC whose driver is not loaded yet is left to systemd-networkd, like one that fails here.
bring_up() {
  current=''
  for link in "$SYS_NET"/*; do
    [ "$(cat "$link/address" 2> /dev/null)" = "$mac" ] && current=${link##*/}
  done
  [ -n "$current" ] || return 0
  if { [ "$current" = "$name" ] || ip link set dev "$current" name "$name"; } \
    && ip link set dev "$name" up && ip address add "$address" dev "$name" \
    && ip route add default via "$gateway" dev "$name"; then
    say "$name is up at $address"
  else
    say "note: $name is left to systemd-networkd"
  fi
}

state=$root/var/lib/vmsandbox
if [ "$(cat "$state/instance-id" 2> /dev/null)" = "$iid" ]; then
  say "instance $iid is set up already"
  bring_up
else
  apply
  bring_up
  mkdir -p -m 0700 "$state" || fail "cannot make $state"
  echo "$iid" | put 644 0:0 "$state/instance-id"
  say "$host is set up (instance $iid)"
fi
exit 0
