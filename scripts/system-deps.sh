#!/usr/bin/env bash
# System tools the launcher tests drive for real: sshd and pdsh (deepspeed --hostfile), mpirun (Open MPI),
# slurmctld/slurmd/sbatch and munged (tests/helpers/slurm.py starts its own cluster; no system service is used).
# Sourced by scripts/test.sh. As root, installs what is missing (apt, quietly); otherwise names what to install.
# Prints nothing when everything is present.
_vdp_missing=()
[ -x /usr/sbin/sshd ] || command -v sshd >/dev/null || _vdp_missing+=(openssh-server)
command -v pdsh >/dev/null || _vdp_missing+=(pdsh)
command -v mpirun >/dev/null || _vdp_missing+=(openmpi-bin)
{ [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && command -v sbatch >/dev/null; } || _vdp_missing+=(slurm-wlm)
[ -x /usr/sbin/munged ] || command -v munged >/dev/null || _vdp_missing+=(munge)
if [ ${#_vdp_missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[system-deps] installing ${_vdp_missing[*]} (one time)" >&2
    export DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes
    apt-get update -qq >&2
    # quiet unless it fails (postinst scripts print service notices on stderr)
    _vdp_log=$(mktemp)
    apt-get install -y -qq --no-install-recommends "${_vdp_missing[@]}" >"$_vdp_log" 2>&1 \
      || { cat "$_vdp_log" >&2; rm -f "$_vdp_log"; exit 1; }
    rm -f "$_vdp_log"; unset _vdp_log
  else
    echo "[system-deps] the launcher tests need ${_vdp_missing[*]}; install them first, e.g." \
         "sudo apt-get install -y --no-install-recommends ${_vdp_missing[*]}" >&2
    exit 1
  fi
fi
unset _vdp_missing
