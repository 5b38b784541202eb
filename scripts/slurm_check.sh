#!/bin/bash
# Runs deploy/slurm/batchwire.sbatch end to end on a real Slurm started here: munge, slurmctld
# and slurmd on localhost (Debian's slurm-wlm, installed if missing), two nodes declared with 32
# CPUs each (SlurmdParameters=config_overrides: the recipe's 16 + 16 CPUs fit on a small
# machine), the embedded dataset, keys from pipeline-keys, CPU trainers (torchrun, 2 ranks, gloo).
#
# This machine has no GPU: the GPU node declares as many stand-in GPUs as the recipe's
# `--gpus-per-node` asks for (gres whose device files are /dev/null's numbers), so Slurm schedules
# the recipe unchanged, and the trainers run --device cpu; the check says so. Through a requeue:
# once the trainers are training, the batch shell gets USR1 (`scancel --signal=USR1 --batch`, what
# the recipe's --signal=B:USR1@120 sends 120 s before the time limit); the recipe passes it to the
# trainers, which checkpoint the step they are at and exit 3, and requeues the job. The trainers
# write no other checkpoint before (--checkpoint-every 0, the signal long before the epoch's end),
# so the requeued run must resume from the signal's step, exactly, and finish. Prints the job's
# output and "slurm_check: OK in N s" or fails.
#
# First, a shorter job: the recipe with two server nodes (bwcpu and bwcpu2), one of them broken (a
# node without the data mount: its pipeline-server is given a --train folder that is not there, by
# a pipeline-server earlier on the job's PATH that runs the real one). The job must end within
# BAD_NODE_LIMIT_S with that node's server named, the other server stopped, no trainer started.
#
# Not part of `make test`: it needs root (daemons, /run/munge, apt), starts system daemons, and
# takes about a minute of a 2-core machine (see bench/RESULTS.md). Usage: scripts/slurm_check.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
WORK=$(mktemp -d /tmp/bw-slurm.XXXXXX)
chmod 0755 "$WORK"  # munged runs as munge
LIMIT_S=${SLURM_CHECK_LIMIT_S:-300}
STEPS=60  # long enough that the first run is still training when it gets USR1
RECIPE=$ROOT/deploy/slurm/batchwire.sbatch
# What the recipe's trainer group asks for, declared on the GPU node (stand-ins: there are none).
GPUS=$(sed -n 's/^#SBATCH --gpus-per-node=\([0-9]*\)$/\1/p' "$RECIPE")
[ -n "$GPUS" ] || { echo "slurm_check: $RECIPE requests no GPUs (#SBATCH --gpus-per-node=N)"; exit 1; }
started=$(date +%s)
pids=()

cleanup() {
    # A job still running (the check stopped early) first: its steps outlive the daemons.
    if [ -n "${job:-}" ] && squeue -h -j "$job" 2>/dev/null | grep -q .; then
        scancel "$job" 2>/dev/null || true
        for _ in $(seq 20); do squeue -h -j "$job" 2>/dev/null | grep -q . || break; sleep 1; done
    fi
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
JobRequeue=1
GresTypes=gpu
NodeName=bwcpu NodeHostname=$host NodeAddr=127.0.0.1 Port=16818 CPUs=32 Weight=1 State=UNKNOWN
NodeName=bwgpu NodeHostname=$host NodeAddr=127.0.0.1 Port=16819 CPUs=32 Gres=gpu:$GPUS Weight=100 State=UNKNOWN
NodeName=bwcpu2 NodeHostname=$host NodeAddr=127.0.0.2 Port=16820 CPUs=32 Weight=10 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
echo "ConstrainCores=no" > "$WORK/cgroup.conf"
# Stand-in GPUs: Slurm keeps only GPUs with a device file, so each is a character device with
# /dev/null's numbers (1, 3); the device plugin (task/none, no cgroups) binds nothing.
mkdir -p "$WORK/dev"
for i in $(seq 0 $(( GPUS - 1 ))); do mknod "$WORK/dev/gpu$i" c 1 3; done
echo "NodeName=bwgpu Name=gpu File=$WORK/dev/gpu[0-$(( GPUS - 1 ))]" > "$WORK/gres.conf"
export SLURM_CONF=$WORK/slurm.conf

slurmctld -f "$SLURM_CONF" -D >"$WORK/log/slurmctld.out" 2>&1 &
pids+=($!)
for node in bwcpu bwgpu bwcpu2; do  # three nodes on this host: bwcpu2 is a second server node
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
export BATCHWIRE_TRAIN_ARGS="pipeline-train --model small --epochs 20 --max-steps $STEPS --checkpoint-every 0 --device cpu --timeout 60"
export BATCHWIRE_CHECKPOINTS=$WORK/checkpoints
export BATCHWIRE_NPROC=2
export OMP_NUM_THREADS=1
echo "slurm_check: no GPU here: node bwgpu declares $GPUS stand-in GPUs (/dev/null's numbers) for" \
    "the recipe's --gpus-per-node=$GPUS; the trainers run --device cpu"
# The broken second server node. Both nodes are this host and the recipe binds every interface,
# so bwcpu's server would answer bwcpu2's /readyz too (127.0.0.2): bwcpu's server starts 5 s late
# (a slow node: a large dataset's index takes longer), so bwcpu2's failure comes first, always.
BAD_NODE_LIMIT_S=${SLURM_CHECK_BAD_NODE_LIMIT_S:-90}
mkdir -p "$WORK/badnode"
cat > "$WORK/badnode/pipeline-server" <<SH
#!/bin/bash
# bwcpu2 stands for a node without the data mount: its server's --train folder is not there.
if [ "\$SLURMD_NODENAME" = bwcpu2 ]; then
    exec "$VENV/bin/pipeline-server" "\$@" --train "$WORK/no-data-mount/train"
fi
sleep 5
exec "$VENV/bin/pipeline-server" "\$@"
SH
chmod +x "$WORK/badnode/pipeline-server"
sed '0,/^#SBATCH --nodes=1$/s//#SBATCH --nodes=2/' "$RECIPE" > "$WORK/two-servers.sbatch"
bad_started=$(date +%s)
bad=$(PATH="$WORK/badnode:$PATH" sbatch --parsable --output="$WORK/bad-%j.out" "$WORK/two-servers.sbatch")
bad=${bad%%+*}
echo "slurm_check: submitted job $bad (two server nodes, bwcpu2 without the data)"
while squeue -h -j "$bad" 2>/dev/null | grep -q .; do
    if [ $(( $(date +%s) - bad_started )) -ge "$BAD_NODE_LIMIT_S" ]; then
        job=$bad
        cat "$WORK"/bad-*.out || true
        echo "slurm_check: job $bad still running after $BAD_NODE_LIMIT_S s with a broken server node"
        exit 1
    fi
    sleep 1
done
bad_out=$(cat "$WORK"/bad-*.out)
echo "$bad_out"
grep -q "batchwire: the server on bwcpu2 exited (2) before" <<<"$bad_out" || {
    echo "slurm_check: the job did not name bwcpu2's server as the one that exited"; exit 1; }
grep -q "batchwire: server step exited" <<<"$bad_out" || {
    echo "slurm_check: the recipe did not stop the other server"; exit 1; }
! grep -q "servers ready" <<<"$bad_out" || { echo "slurm_check: trainers started"; exit 1; }
[ "$(cat "$WORK/batchwire-state/$bad.1/bwcpu2" 2>/dev/null)" = 2 ] || {
    echo "slurm_check: no exit file of bwcpu2's server under BATCHWIRE_STATE"; exit 1; }
echo "slurm_check: a broken server node ended its job in $(( $(date +%s) - bad_started )) s"

job=$(sbatch --parsable --output="$WORK/job-%j.out" "$RECIPE")
job=${job%%+*}
echo "slurm_check: submitted job $job"
deadline=$(( $(date +%s) + LIMIT_S ))

fail() {
    echo "slurm_check: $*"
    squeue -a -o '%i %T %r %N' || true
    sinfo -N -o '%N %T %E' || true
    scontrol show job "$job" || true
    tail -n 20 "$WORK"/log/* || true
    scancel "$job" 2>/dev/null || true
    cat "$WORK"/job-*.out || true
    exit 1
}
restarts() { scontrol show job "$job" 2>/dev/null | grep -o 'Restarts=[0-9]*' | head -n 1 | cut -d= -f2; }

# The first run: once it has trained its first step (the trainers log it), USR1 to the batch
# shell, as at the time limit. No checkpoint is on disk yet.
while ! grep -qs "^step 1 (epoch 0" "$WORK"/job-*.out; do
    squeue -h -j "$job" 2>/dev/null | grep -q . || fail "job $job ended before its first step"
    [ "$(date +%s)" -lt "$deadline" ] || fail "no training step after $LIMIT_S s"
    sleep 0.2
done
scancel --signal=USR1 --batch "$job"
before=$({ find "$BATCHWIRE_CHECKPOINTS" -name 'ckpt-*.pt' 2>/dev/null || true; } | wc -l)
echo "slurm_check: the trainers are training ($before checkpoints); sent USR1 to the batch shell"
[ "$before" = 0 ] || fail "a checkpoint was written before USR1: the check cannot tell them apart"

# The requeued run: it must start again and finish. A requeued job waits 121 s (cred_expire) to
# start, and an idle Slurm runs its backfill pass (the only one that starts heterogeneous jobs)
# only after some change, which a busy cluster always has: the check starts it now instead.
started_again=0
while [ "$(restarts)" != 1 ] || squeue -h -j "$job" 2>/dev/null | grep -q .; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "job $job not requeued and finished after $LIMIT_S s"
    if [ "$started_again" = 0 ] && [ "$(restarts)" = 1 ] \
        && squeue -h -j "$job" -o %T 2>/dev/null | grep -q PENDING; then
        scontrol update JobId="$job" StartTime=now
        echo "slurm_check: job $job requeued; starting it now (StartTime=now)"
        started_again=1
    fi
    sleep 1
done
out=$(cat "$WORK"/job-*.out)
echo "$out"
state=$(scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z]*' | head -n 1 || true)
echo "slurm_check: $state, Restarts=$(restarts)"
grep -q "USR1 (time limit near)" <<<"$out" || fail "the recipe did not trap USR1"
grep -q "run 2;" <<<"$out" || fail "no second run"
# torchrun passed USR1 to both ranks, they wrote the step they were at, the recipe saw that
# checkpoint, and the requeued run resumed from exactly it.
said=$(grep -o "^checkpointed at step [0-9]* on SIGUSR1" <<<"$out" || true)
[ "$(wc -l <<<"$said")" = 1 ] && [ -n "$said" ] || fail "the trainers did not checkpoint once on USR1"
step=$(cut -d' ' -f4 <<<"$said")
ckpt=$BATCHWIRE_CHECKPOINTS/ckpt-$(printf %09d "$step").pt
[ "$(grep -c "closing signal SIGUSR1" <<<"$out")" = 2 ] || fail "torchrun did not pass USR1 to 2 ranks"
grep -q "batchwire: checkpoint on USR1: $ckpt$" <<<"$out" || fail "the recipe did not see $ckpt"
grep -q "resumed from $ckpt: epoch 0, batch $step, step $step$" <<<"$out" \
    || fail "the requeued trainers did not resume from $ckpt, the checkpoint of USR1's step"
echo "slurm_check: USR1 at step $step; the requeued run resumed from $(basename "$ckpt")"
[ "$(grep -c "batchwire: trainers exited 0" <<<"$out")" = 1 ] || fail "the trainers did not finish once"
[ -f "$BATCHWIRE_CHECKPOINTS/ckpt-$(printf %09d "$STEPS").pt" ] || fail "no checkpoint of step $STEPS"
[ "$(grep -c "drained in" <<<"$out")" -ge 2 ] || fail "the servers did not drain in both runs"
[ ! -e "$WORK/batchwire-state/$job.1" ] && [ ! -e "$WORK/batchwire-state/$job.2" ] \
    || fail "the runs' exit-file folders were left under BATCHWIRE_STATE"
echo "slurm_check: OK in $(( $(date +%s) - started )) s"
