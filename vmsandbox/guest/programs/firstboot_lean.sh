#!/bin/sh
# vmsandbox's first boot without an interpreter: applies the plain-text file `vmsandbox-firstboot`
# that vmsandbox adds to the NoCloud seed of a sandbox needing no guest setup (no files, no
# commands, a static NIC). The minimal image's initramfs runs it with busybox before systemd
# starts (images/common/lean.sh); seeds without the file are left to the Python unit
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
#
# Under TCG every process started costs milliseconds: what shell builtins can do (read, printf,
# redirections) is done with them, not with programs.
set -u
umask 022
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

# put MODE OWNER PATH TEXT: TEXT into a new file PATH (never through a link or into a file left
# there), its owner's alone until it has its owner and mode.
put() {
  if [ -e "$3" ] || [ -L "$3" ]; then rm -f "$3" || fail "cannot replace $3"; fi
  umask 077
  printf %s "$4" > "$3" || fail "cannot write $3"
  umask 022
  if [ "$2" != 0:0 ]; then chown "$2" "$3" || fail "cannot give $3 to $2"; fi
  if [ "$1" != 600 ]; then chmod "$1" "$3" || fail "cannot make $3 mode $1"; fi
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
while read -r keyfile _data; do
  case $keyfile in
    '' | ssh_host_rsa_key | ssh_host_ecdsa_key | ssh_host_ed25519_key) ;;
    ssh_host_rsa_key.pub | ssh_host_ecdsa_key.pub | ssh_host_ed25519_key.pub) ;;
    *) fail "$file host-key '$keyfile' is not an SSH host key file" ;;
  esac
done << EOF
$hostkeys
EOF
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
case ${address#*/} in
  "$address" | '' | *[!0-9]*) fail "$file nic address '$address' has no prefix length" ;;
esac

# The login.defs values useradd reads, as def_NAME (Debian's defaults where one is not set).
read_defs() {
  def_UID_MIN=1000 def_UID_MAX=60000 def_GID_MIN=1000 def_GID_MAX=60000
  def_PASS_MIN_DAYS=0 def_PASS_MAX_DAYS=99999 def_PASS_WARN_AGE=7
  def_SUB_UID_MIN=100000 def_SUB_UID_COUNT=65536 def_SUB_GID_MIN=100000 def_SUB_GID_COUNT=65536
  while read -r key value _; do
    case $key in
      UID_MIN | UID_MAX | GID_MIN | GID_MAX | PASS_MIN_DAYS | PASS_MAX_DAYS | PASS_WARN_AGE) ;;
      SUB_UID_MIN | SUB_UID_COUNT | SUB_GID_MIN | SUB_GID_COUNT) ;;
      *) continue ;;
    esac
    case $value in '' | *[!0-9]*) continue ;; esac
    eval "def_$key=\$value"
  done < "$root/etc/login.defs"
}

# next_id FILE MIN MAX: one above the highest id (field 3) of FILE within MIN..MAX, or MIN when
# none is, in $id.
next_id() {
  id=$2
  while IFS=: read -r _ _ number _; do
    case $number in '' | *[!0-9]*) continue ;; esac
    if [ "$number" -ge "$2" ] && [ "$number" -le "$3" ] && [ "$number" -ge "$id" ]; then
      id=$((number + 1))
    fi
  done < "$1"
}

# The uid, gid and home of $user in the guest's passwd, in $uid, $gid and $home; false when it
# has no such user.
account() {
  while IFS=: read -r login _ uid gid _ home _; do
    [ "$login" = "$user" ] && return 0
  done < "$root/etc/passwd"
  return 1
}

# next_sub FILE MIN COUNT: "$user:FIRST:COUNT" added to FILE (/etc/subuid or /etc/subgid), FIRST
# the first id after every range there, at least MIN; nothing when FILE is not there.
next_sub() {
  [ -f "$1" ] && [ "$3" -gt 0 ] || return 0
  first=$2
  while IFS=: read -r _ start count; do
    case $start$count in '' | *[!0-9]*) continue ;; esac
    [ $((start + count)) -le "$first" ] || first=$((start + count))
  done < "$1"
  echo "$user:$first:$3" >> "$1" || fail "cannot write $1"
}

# useradd --create-home --user-group --shell SHELL USER, as Debian's shadow makes it.
add_user() {
  etc=$root/etc
  read_defs
  next_id "$etc/passwd" "$def_UID_MIN" "$def_UID_MAX"
  uid=$id gid=$id
  while IFS=: read -r _ _ number _; do
    [ "$number" = "$gid" ] || continue
    next_id "$etc/group" "$def_GID_MIN" "$def_GID_MAX"
    gid=$id
    break
  done < "$etc/group"
  days=$(($(date +%s) / 86400))
  shadow="$user:!:$days:$def_PASS_MIN_DAYS:$def_PASS_MAX_DAYS:$def_PASS_WARN_AGE:::"
  {
    echo "$user:x:$uid:$gid::/home/$user:$shell" >> "$etc/passwd" \
      && echo "$user:x:$gid:" >> "$etc/group" \
      && echo "$shadow" >> "$etc/shadow" \
      && { [ ! -f "$etc/gshadow" ] || echo "$user:!::" >> "$etc/gshadow"; }
  } || fail "cannot add user $user to $etc"
  next_sub "$etc/subuid" "$def_SUB_UID_MIN" "$def_SUB_UID_COUNT"
  next_sub "$etc/subgid" "$def_SUB_GID_MIN" "$def_SUB_GID_COUNT"
  home=$root/home/$user
  mkdir -p "$root/home" && mkdir -m 0755 "$home" && cp -a "$etc/skel/." "$home/" \
    && chown -R "$uid:$gid" "$home" || fail "cannot make the home folder $home"
}

apply() {
  echo "$host" > /proc/sys/kernel/hostname || fail "cannot set the hostname $host"
  put 644 0:0 "$root/etc/hostname" "$host
"
  put 644 0:0 "$root/etc/hosts" "127.0.0.1 localhost
127.0.1.1 $host
::1 localhost ip6-localhost ip6-loopback
ff02::1 ip6-allnodes
ff02::2 ip6-allrouters
"

  rm -f "$root"/etc/ssh/ssh_host_*
  while read -r keyfile data; do
    [ -n "$keyfile" ] || continue
    path=$root/etc/ssh/$keyfile
    umask 077
    base64 -d > "$path" << KEY || fail "host-key $keyfile is not base64 text"
$data
KEY
    umask 022
    [ -s "$path" ] || fail "host-key $keyfile is not base64 text"
    case $keyfile in *.pub) chmod 644 "$path" || fail "cannot make $path mode 644" ;; esac
  done << EOF
$hostkeys
EOF

  account || add_user
  account || fail "user $user is not in $root/etc/passwd"
  ssh=$root$home/.ssh
  [ -d "$ssh" ] || mkdir -m 0700 "$ssh" || fail "cannot make $ssh"
  chown "$uid:$gid" "$ssh" || fail "cannot give $ssh to $user"
  put 600 "$uid:$gid" "$ssh/authorized_keys" "$keys"
  if [ -n "$sudo" ]; then
    [ -d "$root/etc/sudoers.d" ] || mkdir -p "$root/etc/sudoers.d" || fail "cannot make sudoers.d"
    put 440 0:0 "$root/etc/sudoers.d/90-vmsandbox-users" "$user $sudo
"
  fi

  network=$root/etc/systemd/network
  [ -d "$network" ] || mkdir -p "$network" || fail "cannot make $network"
  put 644 0:0 "$network/50-vmsandbox-$name.link" "[Match]
MACAddress=$mac

[Link]
Name=$name
"
  dns='' resolv=''
  for server in $servers; do
    dns="${dns}DNS=$server
"
    resolv="${resolv}nameserver $server
"
  done
  put 644 0:0 "$network/50-vmsandbox-$name.network" "[Match]
MACAddress=$mac

[Network]
LinkLocalAddressing=no
IPv6AcceptRA=no
KeepConfiguration=static
Address=$address
Gateway=$gateway
$dns"
  [ -z "$resolv" ] || put 644 0:0 "$root/etc/resolv.conf" "$resolv"
}

# The NIC up with its address and gateway, at every boot: sshd answers as soon as it listens.
# A NIC whose driver is not loaded yet is left to systemd-networkd, like one that fails here.
bring_up() {
  current=''
  for link in "$SYS_NET"/*; do
    [ -f "$link/address" ] && read -r seen < "$link/address" && [ "$seen" = "$mac" ] \
      && current=${link##*/}
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
done_iid=''
[ ! -f "$state/instance-id" ] || read -r done_iid < "$state/instance-id"
if [ "$done_iid" = "$iid" ]; then
  say "instance $iid is set up already"
  bring_up
else
  apply
  bring_up
  [ -d "$state" ] || { mkdir -p "${state%/*}" && mkdir -m 0700 "$state"; } || fail "cannot make $state"
  put 644 0:0 "$state/instance-id" "$iid
"
  say "$host is set up (instance $iid)"
fi
exit 0
