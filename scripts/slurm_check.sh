#!/bin/bash
# Runs deploy/slurm/batchwire.sbatch end to end on a real Slurm started here: munge, slurmctld
# and slurmd on localhost (Debian's slurm-wlm, installed if missing), one node declared with 64
# CPUs (SlurmdParameters=config_overrides: the recipe's 16 + 32 CPUs fit on a small machine),
# the embedded dataset, keys from pipeline-keys, CPU trainers (torchrun, 2 ranks, gloo) doing a
# couple of steps. Prints the job's output and "slurm_check: OK in N s" or fails.
#
# Not part of `make test`: it needs root (daemons, /run/munge, apt), starts system daemons, and
# takes ~1 minute of a 2-core machine (see bench/RESULTS.md). Usage: scripts/slurm_check.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
WORK=$(mktemp -d /tmp/bw-slurm.XXXXXX)
chmod 0755 "$WORK"  # munged runs as munge
LIMIT_S=${SLURM_CHECK_LIMIT_S:-300}
started=$(date +%s)
pids=()

cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    sleep 1
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    [ "$(id -u)" = 0 ] || { echo "slurm_check: needs root to install slurm-wlm"; exit 2; }
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        --no-install-recommends slurm-wlm munge
fi

# munge: its own key for this run, its socket in /run/munge.
mkdir -p /run/munge "$WORK/munge"
chown munge:munge /run/munge "$WORK/munge"
chmod 0755 /run/munge
dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 status=none
chown munge:munge "$WORK/munge/munge.key" && chmod 0400 "$WORK/munge/munge.key"
runuser -u munge -- munged --key-file="$WORK/munge/munge.key" \
    --socket=/run/munge/munge.socket.2 --pid-file="$WORK/munge/munged.pid" \
    --log-file="$WORK/munge/munged.log" --seed-file="$WORK/munge/seed" --force
sleep 0.5
pids+=("$(cat "$WORK/munge/munged.pid")")

host=$(hostname -s)
mkdir -p "$WORK/state" "$WORK/spool" "$WORK/log"
cat > "$WORK/slurm.conf" <<CONF
ClusterName=bwcheck
SlurmctldHost=$host(127.0.0.1)
AuthType=auth/munge
SlurmUser=root
SlurmctldPort=16817
SlurmdPort=16818
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool/%n
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd-%n.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1  # heterogeneous jobs start only from the backfill pass
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=30
NodeName=bwcpu NodeHostname=$host NodeAddr=127.0.0.1 Port=16818 CPUs=32 State=UNKNOWN
NodeName=bwgpu NodeHostname=$host NodeAddr=127.0.0.1 Port=16819 CPUs=32 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
echo "ConstrainCores=no" > "$WORK/cgroup.conf"
export SLURM_CONF=$WORK/slurm.conf

slurmctld -f "$SLURM_CONF" -D >"$WORK/log/slurmctld.out" 2>&1 &
pids+=($!)
for node in bwcpu bwgpu; do  # two nodes on this host: one per heterogeneous component
    mkdir -p "$WORK/spool/$node"
    slurmd -f "$SLURM_CONF" -N "$node" -D >"$WORK/log/slurmd-$node.out" 2>&1 &
    pids+=($!)
done
for _ in $(seq 60); do
    state=$(sinfo -h -N -o %t 2>/dev/null | sort -u | tr '\n' ' ' | xargs || true)
    [ "$state" = idle ] && break
    sleep 1
done
[ "${state:-}" = idle ] || {
    echo "slurm_check: node not idle (state '${state:-}')"
    tail -n 30 "$WORK"/log/*
    exit 1
}
echo "slurm_check: Slurm $(sinfo -V | cut -d' ' -f2) up ($host idle) in $(( $(date +%s) - started )) s"

DATA=$("$VENV/bin/python" -c \
    'from batchwire.pipeline.synthetic import default_dataset as d; print(d().train_root.parent)')
cd "$WORK"
export PATH="$VENV/bin:$PATH"
export BATCHWIRE_DATA=$DATA
export BATCHWIRE_KEYS=$WORK/keys
export BATCHWIRE_PORT=25555 BATCHWIRE_METRICS_PORT=29100
export BATCHWIRE_SERVER_ARGS="--batch-size 16 --image-size 32 --output-dtype uint8 --producers 2 --workers 1 --drain-timeout 10"
export BATCHWIRE_TRAIN_ARGS="pipeline-train --model small --epochs 1 --max-steps 2 --device cpu --timeout 60"
export BATCHWIRE_NPROC=2
export OMP_NUM_THREADS=1
job=$(sbatch --parsable --output="$WORK/job-%j.out" "$ROOT/deploy/slurm/batchwire.sbatch")
echo "slurm_check: submitted job $job"
deadline=$(( $(date +%s) + LIMIT_S ))
while squeue -h -j "${job%%+*}" 2>/dev/null | grep -q .; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
        echo "slurm_check: job $job still running after $LIMIT_S s; cancelling"
        squeue -a -o '%i %T %r %N' || true
        scontrol show job "${job%%+*}" || true
        tail -n 20 "$WORK"/log/* || true
        scancel "${job%%+*}"
        cat "$WORK"/job-*.out || true
        exit 1
    fi
    sleep 1
done
out=$(cat "$WORK"/job-*.out)
echo "$out"
state=$(scontrol show job "${job%%+*}" 2>/dev/null | grep -o 'JobState=[A-Z]*' | head -n 1 || true)
echo "slurm_check: $state"
grep -q "batchwire: trainers exited 0" <<<"$out" || { echo "slurm_check: trainers failed"; exit 1; }
grep -q "drained in" <<<"$out" || { echo "slurm_check: the servers did not drain"; exit 1; }
echo "slurm_check: OK in $(( $(date +%s) - started )) s"
