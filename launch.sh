#!/usr/bin/env bash
# One entry for every launcher. Prints the command (and the environment it sets) before running it.
#
#   launch.sh [--launcher auto|local|deepspeed|torchrun|slurm|openmpi] [--nproc N] [--hostfile FILE]
#             [--nnodes N --node-rank R --master-addr HOST] [--master-port P] [--device cpu|cuda|npu]
#             [--nnodes MIN:MAX --max-restarts N --master-addr HOST] [--dry-run] -- train.py ARGS...
#
# --nproc N: processes on each node (one a device; default: the devices this node has), not the total:
# the world size (train.py's and parallel.plan's --world-size) is --nproc x the nodes (--nnodes, or the
# hostfile's slots). Flags are spelled with dashes; the underscore spelling works too (--node_rank).
# A refusal prints `launch.sh refused (1 problem):` and the problem, and exits 1, as every command does.
#
# --nnodes MIN:MAX: elastic (torchrun's agent, c10d rendezvous at --master-addr:--master-port, the same
# command on every node, no --node-rank): when a node is lost the run restarts by itself on the nodes that
# remain (at least MIN, at most --max-restarts times, default 3) and resumes from the newest verified
# checkpoint, train.grad_accum_steps re-derived to keep the global batch (docs/multi-node.md).
#
# --dry-run prints what each host will use (its ranks, the master address and port), runs train.py's checker
# for that world size, prints the command and exits. The master: --master-addr; else the first host of the
# hostfile (deepspeed over ssh resolves it itself, `ssh FIRST hostname -I`); else Slurm's first node; else
# 127.0.0.1 on one host. torchrun --nnodes N > 1 needs --master-addr (parallel/distributed/master.py).
#
# auto picks: inside an allocation of slurm (SLURM_JOB_ID) -> slurm; with --hostfile -> deepspeed over
# pdsh/ssh (with --node-rank R: no ssh, run this on every node); otherwise one node (local:
# `deepspeed --num_gpus N`). Ranks read RANK/WORLD_SIZE/LOCAL_RANK,
# OMPI_COMM_WORLD_*, PMI_* or SLURM_* themselves (parallel/distributed/topology.py), so every launcher trains alike.
set -euo pipefail

launcher=auto nproc="" hostfile="" nnodes=1 node_rank="" master_addr="" master_port=29500
device="" dry_run=0 max_restarts=""
die() { printf 'launch.sh refused (1 problem):\n  - %s\n' "$*" >&2; exit 1; }
usage() { sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }
while [ $# -gt 0 ]; do
  case "$1" in --*_*) set -- "$(printf '%s' "${1%%=*}" | tr _ -)${1#"${1%%=*}"}" "${@:2}" ;; esac    # --node_rank
  case "$1" in
    --launcher) launcher="$2"; shift 2 ;;
    --nproc) nproc="$2"; shift 2 ;;
    --hostfile) hostfile="$2"; shift 2 ;;
    --nnodes) nnodes="$2"; shift 2 ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --master-addr) master_addr="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    --max-restarts) max_restarts="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option $1 (options go before --, train.py's arguments after it)" ;;
  esac
done
[ $# -gt 0 ] || die "nothing to launch: launch.sh [options] -- train.py --config ... --deepspeed-config ..."
PY="${PYTHON:-python}"

elastic=0
case "$nnodes" in *:*)
  elastic=1
  [ "$launcher" = auto ] && launcher=torchrun
  [ "$launcher" = torchrun ] || die "--nnodes $nnodes (elastic) runs under torchrun's agent: drop --launcher $launcher"
  [ -z "$node_rank" ] || die "--nnodes $nnodes (elastic): the rendezvous numbers the nodes; drop --node-rank" ;;
esac
[ "$elastic" = 1 ] || [ -z "$max_restarts" ] || die "--max-restarts: only an elastic run (--nnodes MIN:MAX) restarts"
if [ "$launcher" = auto ]; then
  if [ -n "${SLURM_JOB_ID:-}" ]; then launcher=slurm
  elif [ -n "$hostfile" ]; then launcher=deepspeed
  else launcher=local; fi
fi

envs=() ds_env=()
case "$device" in
  npu)
    envs+=(DS_ACCELERATOR=npu)
    n="${nproc:-8}"
    envs+=("ASCEND_RT_VISIBLE_DEVICES=${ASCEND_RT_VISIBLE_DEVICES:-$(seq -s, 0 $((n - 1)))}")
    envs+=("HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1200}" "HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1200}") ;;
  cuda|cpu) envs+=("DS_ACCELERATOR=$device") ;;
  "") ;;
  *) die "--device $device: use cpu, cuda or npu" ;;
esac
if [ -z "$nproc" ] && [ "$launcher" != slurm ] && [ "$launcher" != deepspeed ] \
   && ! { [ "$launcher" = openmpi ] && [ -n "$hostfile" ]; }; then
  # the last line: DeepSpeed logs its accelerator detection to stdout
  nproc=$(env "${envs[@]}" "$PY" -c 'from parallel.distributed import accelerator; print(accelerator.device_count())' \
          2>/dev/null | tail -n 1) || die "could not count devices; pass --nproc N"
fi
# The master address, the world size and (Open MPI with a hostfile) the rank count: "-" for none
where=(--launcher "$launcher" --master-port "$master_port" --nnodes "$nnodes")
for o in hostfile master_addr nproc node_rank; do [ -z "${!o}" ] || where+=("--${o//_/-}" "${!o}"); done
[ "$dry_run" = 1 ] && where+=(--describe)
plan=$("$PY" -m parallel.distributed.master "${where[@]}") || exit $?
read -r master_addr world nproc <<<"$plan"
for v in master_addr world nproc; do [ "${!v}" != - ] || printf -v "$v" ''; done

case "$launcher" in
  local)
    cmd=(deepspeed --num_gpus "$nproc" --master_port "$master_port" "$@") ;;
  deepspeed)
    [ -n "$hostfile" ] || die "--launcher deepspeed needs --hostfile (lines 'host slots=N')"
    cmd=(deepspeed --hostfile "$hostfile")
    [ -z "$master_addr" ] || cmd+=(--master_addr "$master_addr")   # none: DeepSpeed asks the first host
    cmd+=(--master_port "$master_port")
    if [ -n "$node_rank" ]; then   # no ssh: the same command runs on every node, each starting its own ranks
      cmd+=(--no_ssh --node_rank "$node_rank")
    else   # pdsh/ssh: remote ranks get this Python environment, the device settings, the thread count and
           # the JIT-op cache from .deepspeed_env (written below), whose lines DeepSpeed exports on every node
      ds_env=("PATH=$(dirname "$(command -v "$PY")"):$PATH" "PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}" "${envs[@]}")
      for v in OMP_NUM_THREADS TORCH_EXTENSIONS_DIR; do [ -z "${!v:-}" ] || ds_env+=("$v=${!v}"); done
    fi
    cmd+=("$@") ;;
  torchrun)
    if [ "$elastic" = 1 ]; then    # one rendezvous id per endpoint. The next round starts once the lost
      # node's agent is declared dead (5 missed 1 s keep-alives; torchrun's default waits 15 s), then waits 5 s
      # (last call) for more nodes
      # A store of its own for each attempt's ranks (rank 0's): the agent's shared one keeps the last attempt's
      # keys, and a restarted rank can read a lost rank's gloo address from it (connectFullMesh times out)
      envs+=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
      # every world a restart may land on, checked by each start of train.py (parallel/elastic.py)
      envs+=("VDP_ELASTIC_WORLDS=$(seq -s, "$((${nnodes%:*} * nproc))" "$nproc" "$((${nnodes#*:} * nproc))")")
      cmd=(torchrun --nproc_per_node "$nproc" --nnodes "$nnodes" --max-restarts "${max_restarts:-3}"
           --rdzv-backend c10d --rdzv-endpoint "$master_addr:$master_port" --rdzv-id "vdp-$master_port"
           --rdzv-conf last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=5 "$@")
    else
      cmd=(torchrun --nproc_per_node "$nproc" --nnodes "$nnodes" --node_rank "${node_rank:-0}"
           --master_addr "$master_addr" --master_port "$master_port" "$@")
    fi ;;
  slurm)
    envs+=("MASTER_ADDR=$master_addr" "MASTER_PORT=$master_port")
    cmd=(srun --kill-on-bad-exit=1 "$PY" "$@") ;;
  openmpi)
    envs+=("MASTER_ADDR=$master_addr" "MASTER_PORT=$master_port")
    # Unbound: each rank runs many threads (intra-op, data loading); Open MPI would pin it to one core.
    cmd=(mpirun -np "$nproc" --bind-to none)
    [ -n "$hostfile" ] && cmd+=(--hostfile "$hostfile")      # Open MPI reads the same 'host slots=N' lines
    [ "$(id -u)" = 0 ] && cmd+=(--allow-run-as-root)          # containers often run as root
    # Ranks on other hosts get only the variables named by -x: the device settings, and the JIT-op cache
    # (without it each host builds DeepSpeed's ops again in ~/.cache, for minutes)
    for e in "${envs[@]}"; do cmd+=(-x "${e%%=*}"); done
    cmd+=(-x PATH -x PYTHONPATH)
    for v in OMP_NUM_THREADS TORCH_EXTENSIONS_DIR; do [ -z "${!v:-}" ] || cmd+=(-x "$v"); done
    cmd+=("$PY" "$@") ;;
  *) die "--launcher $launcher: use auto, local, deepspeed, torchrun, slurm or openmpi" ;;
esac

if [ "$dry_run" = 1 ]; then     # train.py's checker at this world size (not the device: that is the ranks')
  if [ "$(basename "$1")" != train.py ]; then echo "launch.sh: not train.py, nothing to check" >&2
  elif [ -z "$world" ]; then echo "launch.sh: the world size is unknown here (SLURM_NTASKS): not checked" >&2
  else env "${envs[@]}" RANK=0 LOCAL_RANK=0 WORLD_SIZE="$world" "$PY" "$@" --check-only >&2 || exit $?; fi
fi
echo "+ ${envs[*]:+${envs[*]} }${cmd[*]}" >&2
[ "$dry_run" = 1 ] && exit 0
[ ${#ds_env[@]} = 0 ] || printf '%s\n' "${ds_env[@]}" > .deepspeed_env
exec env "${envs[@]}" "${cmd[@]}"
