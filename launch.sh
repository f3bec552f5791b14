#!/usr/bin/env bash
# One entry for every launcher. Prints the command (and the environment it sets) before running it.
#
#   launch.sh [--launcher auto|local|deepspeed|torchrun|slurm|openmpi] [--nproc N] [--hostfile FILE]
#             [--nnodes N --node-rank R --master-addr HOST] [--master-port P] [--device cpu|cuda|npu]
#             [--dry-run] -- train.py ARGS...
#
# auto picks: inside an allocation of slurm (SLURM_JOB_ID) -> slurm; with --hostfile -> deepspeed over
# pdsh/ssh (with --node-rank R: no ssh, run this on every node); otherwise one node (local:
# `deepspeed --num_gpus N`). Ranks read RANK/WORLD_SIZE/LOCAL_RANK,
# OMPI_COMM_WORLD_*, PMI_* or SLURM_* themselves (parallel/distributed/topology.py), so every launcher trains alike.
set -euo pipefail

launcher=auto nproc="" hostfile="" nnodes=1 node_rank="" master_addr=127.0.0.1 master_port=29500
device="" dry_run=0
die() { echo "launch.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --launcher) launcher="$2"; shift 2 ;;
    --nproc) nproc="$2"; shift 2 ;;
    --hostfile) hostfile="$2"; shift 2 ;;
    --nnodes) nnodes="$2"; shift 2 ;;
    --node-rank) node_rank="$2"; shift 2 ;;
    --master-addr) master_addr="$2"; shift 2 ;;
    --master-port) master_port="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    *) die "unknown option $1 (options go before --, train.py's arguments after it)" ;;
  esac
done
[ $# -gt 0 ] || die "nothing to launch: launch.sh [options] -- train.py --config ... --deepspeed_config ..."
PY="${PYTHON:-python}"

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
if [ -n "$hostfile" ]; then
  slots=$("$PY" -m parallel.distributed.hostfile "$hostfile" | awk '{n += $2} END {print n}') || exit 2
  [ "$launcher" = openmpi ] && nproc="${nproc:-$slots}"
fi
if [ -z "$nproc" ] && [ "$launcher" != slurm ] && [ "$launcher" != deepspeed ]; then
  nproc=$(env "${envs[@]}" "$PY" -c 'from parallel import accelerator; print(accelerator.device_count())' 2>/dev/null) \
    || die "could not count devices; pass --nproc N"
fi

case "$launcher" in
  local)
    cmd=(deepspeed --num_gpus "$nproc" --master_port "$master_port" "$@") ;;
  deepspeed)
    [ -n "$hostfile" ] || die "--launcher deepspeed needs --hostfile (lines 'host slots=N')"
    cmd=(deepspeed --hostfile "$hostfile" --master_addr "$master_addr" --master_port "$master_port")
    if [ -n "$node_rank" ]; then   # no ssh: the same command runs on every node, each starting its own ranks
      cmd+=(--no_ssh --node_rank "$node_rank")
    else   # pdsh/ssh: remote ranks get this Python environment, the device settings, the thread count and
           # the JIT-op cache from .deepspeed_env (written below), whose lines DeepSpeed exports on every node
      ds_env=("PATH=$(dirname "$(command -v "$PY")"):$PATH" "PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}" "${envs[@]}")
      for v in OMP_NUM_THREADS TORCH_EXTENSIONS_DIR; do [ -z "${!v:-}" ] || ds_env+=("$v=${!v}"); done
    fi
    cmd+=("$@") ;;
  torchrun)
    cmd=(torchrun --nproc_per_node "$nproc" --nnodes "$nnodes" --node_rank "${node_rank:-0}"
         --master_addr "$master_addr" --master_port "$master_port" "$@") ;;
  slurm)
    first=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}" | head -n 1)
    # The node's NodeAddr (slurm.conf; it defaults to the node name): node names need not resolve
    addr=$(scontrol show node -o "$first" 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' || true)
    envs+=("MASTER_ADDR=${addr:-$first}" "MASTER_PORT=$master_port")
    cmd=(srun --kill-on-bad-exit=1 "$PY" "$@") ;;
  openmpi)
    envs+=("MASTER_ADDR=$master_addr" "MASTER_PORT=$master_port")
    # Unbound: each rank runs many threads (intra-op, data loading); Open MPI would pin it to one core.
    cmd=(mpirun -np "$nproc" --bind-to none)
    [ -n "$hostfile" ] && cmd+=(--hostfile "$hostfile")      # Open MPI reads the same 'host slots=N' lines
    [ "$(id -u)" = 0 ] && cmd+=(--allow-run-as-root)          # containers often run as root
    cmd+=(-x MASTER_ADDR -x MASTER_PORT -x PATH -x PYTHONPATH ${OMP_NUM_THREADS:+-x OMP_NUM_THREADS} "$PY" "$@") ;;
  *) die "--launcher $launcher: use auto, local, deepspeed, torchrun, slurm or openmpi" ;;
esac

echo "+ ${envs[*]:+${envs[*]} }${cmd[*]}" >&2
[ "$dry_run" = 1 ] && exit 0
[ ${#ds_env[@]} = 0 ] || printf '%s\n' "${ds_env[@]}" > .deepspeed_env
exec env "${envs[@]}" "${cmd[@]}"
