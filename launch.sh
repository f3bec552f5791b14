#!/usr/bin/env bash
# One entry for every launcher. Prints the command (and the environment it sets) before running it.
#
#   launch.sh [--launcher auto|local|deepspeed|torchrun|slurm|openmpi] [--nproc N] [--hostfile FILE]
#             [--nnodes N --node-rank R --master-addr HOST] [--master-port P] [--device cpu|cuda|npu]
#             [--dry-run] -- train.py ARGS...
#
# auto picks: inside an allocation of slurm (SLURM_JOB_ID) -> slurm; with --hostfile -> deepspeed over
# pdsh/ssh; otherwise one node (local: `deepspeed --num_gpus N`). Ranks read RANK/WORLD_SIZE/LOCAL_RANK,
# OMPI_COMM_WORLD_*, PMI_* or SLURM_* themselves (parallel/topology.py), so every launcher trains alike.
set -euo pipefail

launcher=auto nproc="" hostfile="" nnodes=1 node_rank=0 master_addr=127.0.0.1 master_port=29500
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

envs=()
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
if [ -z "$nproc" ] && [ "$launcher" != slurm ] && [ "$launcher" != deepspeed ]; then
  nproc=$(env "${envs[@]}" "$PY" -c 'from parallel import accelerator; print(accelerator.device_count())' 2>/dev/null) \
    || die "could not count devices; pass --nproc N"
fi

case "$launcher" in
  local)
    cmd=(deepspeed --num_gpus "$nproc" --master_port "$master_port" "$@") ;;
  deepspeed)
    [ -n "$hostfile" ] || die "--launcher deepspeed needs --hostfile (lines 'host slots=N')"
    "$PY" -m parallel.hostfile "$hostfile" >/dev/null || exit 2
    # Remote ranks get this Python environment: DeepSpeed exports .deepspeed_env's lines over pdsh.
    printf 'PATH=%s\nPYTHONPATH=%s\n' "$(dirname "$(command -v "$PY")"):$PATH" "$PWD${PYTHONPATH:+:$PYTHONPATH}" \
      > .deepspeed_env
    cmd=(deepspeed --hostfile "$hostfile" --master_addr "$master_addr" --master_port "$master_port" "$@") ;;
  torchrun)
    cmd=(torchrun --nproc_per_node "$nproc" --nnodes "$nnodes" --node_rank "$node_rank"
         --master_addr "$master_addr" --master_port "$master_port" "$@") ;;
  slurm)
    first=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}" | head -n 1)
    envs+=("MASTER_ADDR=$first" "MASTER_PORT=$master_port")
    cmd=(srun --kill-on-bad-exit=1 "$PY" "$@") ;;
  openmpi)
    envs+=("MASTER_ADDR=$master_addr" "MASTER_PORT=$master_port")
    cmd=(mpirun -np "$nproc" -x MASTER_ADDR -x MASTER_PORT -x PATH -x PYTHONPATH "$PY" "$@") ;;
  *) die "--launcher $launcher: use auto, local, deepspeed, torchrun, slurm or openmpi" ;;
esac

echo "+ ${envs[*]:+${envs[*]} }${cmd[*]}" >&2
[ "$dry_run" = 1 ] && exit 0
exec env "${envs[@]}" "${cmd[@]}"
