#!/usr/bin/env bash
# System tools the launcher tests drive for real: sshd and pdsh (deepspeed --hostfile), mpirun (Open MPI).
# Sourced by scripts/test.sh. As root, installs what is missing (apt, quietly); otherwise names what to install.
# Prints nothing when everything is present.
_vdp_missing=()
[ -x /usr/sbin/sshd ] || command -v sshd >/dev/null || _vdp_missing+=(openssh-server)
command -v pdsh >/dev/null || _vdp_missing+=(pdsh)
command -v mpirun >/dev/null || _vdp_missing+=(openmpi-bin)
if [ ${#_vdp_missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[system-deps] installing ${_vdp_missing[*]} (one time)" >&2
    export DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${_vdp_missing[@]}" >/dev/null
  else
    echo "[system-deps] the launcher tests need ${_vdp_missing[*]}; install them first, e.g." \
         "sudo apt-get install -y --no-install-recommends ${_vdp_missing[*]}" >&2
    exit 1
  fi
fi
unset _vdp_missing
