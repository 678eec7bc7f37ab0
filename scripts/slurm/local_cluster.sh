#!/usr/bin/env bash
# local_cluster.sh — a real, self-contained SLURM "cluster" on ONE machine, for shardsafe's tests
# (tests/slurm) and for trying scripts/slurm/pretrain_*.sbatch without a cluster: a private munged,
# slurmctld and N slurmd daemons (one per fake node, SLURM's "multiple slurmd" mode:
# NodeHostname=localhost, one port and one loopback address 127.0.1.i per node).
# Made for Debian 12's Slurm 22.05 without systemd (docs/slurm.md "Trying it without a cluster").
#
#   local_cluster.sh up       install slurmctld slurmd slurm-client munge with apt if missing, start;
#                             prints `export SLURM_CONF=...`
#   local_cluster.sh down     cancel jobs, stop the daemons, sweep leftovers BY PID, remove the dir:
#                             nothing of this cluster keeps running
#   local_cluster.sh status   sinfo / squeue
#   source "$SLURM_CI_DIR/env.sh"   -> SLURM_CONF for srun/sbatch/squeue/scontrol
#
# Knobs (env): SLURM_CI_DIR (/tmp/shardsafe-slurm)  SLURM_CI_NODES (4)  SLURM_CI_CPUS (2)
#              SLURM_CI_MEM_MB (2000)  SLURM_CI_PORT (16817; nodes use PORT+1..PORT+N)
#              SLURM_CI_SLURMD_TIMEOUT (10)  SLURM_CI_MSG_TIMEOUT (10; 5+3 => hard node crash detected in ~10 s)
#              SLURM_CI_KEEP (0: down removes the dir)
#              SLURM_CI_PROCTRACK (proctrack/linuxproc)  SLURM_CI_TASKPLUGIN (task/none)
#              SLURM_CI_RETURN_TO_SERVICE (2: a node set DOWN with scontrol comes back by itself; it is
#              removed from running jobs either way)
# Needs root (daemons run as root, SlurmUser=root) and, for the first `up`, apt.
# cgroup plugins are not used: they do not work in containers/VMs with hybrid cgroups (see the recipe).
set -uo pipefail
D=${SLURM_CI_DIR:-/tmp/shardsafe-slurm}
N=${SLURM_CI_NODES:-4}
CPUS=${SLURM_CI_CPUS:-2}
MEM=${SLURM_CI_MEM_MB:-2000}
PORT=${SLURM_CI_PORT:-16817}
SDT=${SLURM_CI_SLURMD_TIMEOUT:-10}
MSGT=${SLURM_CI_MSG_TIMEOUT:-10}
export SLURM_CONF=$D/etc/slurm.conf
TAG="SLURM_CI_TAG=$D"        # env marker carried by our daemons and their slurmstepds

log() { echo "[slurm-ci $(date +%T.%3N)] $*" >&2; }

install_pkgs() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
     command -v srun >/dev/null && command -v munged >/dev/null; then return 0; fi
  log "installing slurmctld slurmd slurm-client munge (apt)"
  local own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then   # keep postinst from starting services
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; own_policy=1
  fi
  apt-get update -qq || return 1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge >/dev/null || return 1
  [ $own_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  return 0
}

write_conf() {
  cat > "$SLURM_CONF" <<EOF
ClusterName=ci
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge/munge.sock,cred_expire=10
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=${SLURM_CI_PROCTRACK:-proctrack/linuxproc}
TaskPlugin=${SLURM_CI_TASKPLUGIN:-task/none}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=${SLURM_CI_RETURN_TO_SERVICE:-2}
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=$SDT
MessageTimeout=$MSGT
InactiveLimit=0
KillWait=5
MinJobAge=300
JobRequeue=1
EOF
  # one slurmd per fake node, each on its own port and its own loopback address
  # (127.0.1.i; all of 127/8 is local on Linux), so per-node services can bind distinct IPs
  for i in $(seq 1 "$N"); do
    echo "NodeName=node$i NodeHostname=localhost NodeAddr=127.0.1.$i Port=$((PORT + i)) CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
  done >> "$SLURM_CONF"
  echo "PartitionName=debug Nodes=node[1-$N] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >> "$SLURM_CONF"
}

# PIDs of processes belonging to THIS cluster: our daemons + slurmstepds (carry TAG),
# and job tasks (carry SLURM_CONF=$SLURM_CONF and a SLURM_JOB_ID). Never ourselves/ancestors.
our_pids() {
  local self=$$ anc=" " p=$$
  while [ "$p" -gt 1 ] 2>/dev/null; do anc+="$p "; p=$(awk '{print $4}' /proc/$p/stat 2>/dev/null || echo 1); done
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}; p=${p%/environ}
    case "$anc" in *" $p "*) continue;; esac
    local env; env=$(tr '\0' '\n' 2>/dev/null < "$e") || continue
    if grep -qxF "$TAG" <<<"$env" ||
       { grep -qxF "SLURM_CONF=$SLURM_CONF" <<<"$env" && grep -q '^SLURM_JOB_ID=' <<<"$env"; }; then
      echo "$p"
    fi
  done
}

alive() {  # running and not a zombie (PID 1 may reap late)
  local st; st=$(awk '{print $3}' /proc/"$1"/stat 2>/dev/null) || return 1
  [ -n "$st" ] && [ "$st" != Z ]
}

wait_gone() {  # wait_gone SECONDS PID...
  local t=$1; shift; local i
  for ((i = 0; i < t * 10; i++)); do
    local alive=0; for p in "$@"; do alive "$p" && alive=1; done
    [ $alive = 0 ] && return 0; sleep 0.1
  done; return 1
}

down() {
  [ -d "$D" ] || { log "nothing to stop ($D absent)"; return 0; }
  if [ -f "$D/run/slurmctld.pid" ] && alive "$(cat "$D/run/slurmctld.pid")" &&
     timeout 5 scontrol ping >/dev/null 2>&1; then
    local jobs; jobs=$(timeout 5 squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
      log "cancelling jobs: $jobs"; scancel $jobs 2>/dev/null
      for i in $(seq 100); do [ -z "$(timeout 5 squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
    fi
    timeout 10 scontrol shutdown >/dev/null 2>&1   # stops slurmctld and every slurmd
  fi
  local pids=""; for f in "$D"/run/*.pid; do [ -f "$f" ] && pids+="$(cat "$f") "; done
  wait_gone 15 $pids || { log "daemons still alive, SIGKILL: $pids"; kill -9 $pids 2>/dev/null; }
  [ -S "$D/munge/munge.sock" ] && munged -s --socket="$D/munge/munge.sock" >/dev/null 2>&1
  if [ -f "$D/munge/munged.pid" ]; then
    local mp; mp=$(cat "$D/munge/munged.pid"); alive "$mp" && kill "$mp" 2>/dev/null
    wait_gone 5 "$mp" || kill -9 "$mp" 2>/dev/null
  fi
  local left; left=$(our_pids | tr '\n' ' ')
  if [ -n "${left// /}" ]; then
    log "leftover processes (stepd/tasks): $left -> TERM"; kill $left 2>/dev/null
    wait_gone 2 $left || kill -9 $left 2>/dev/null
  fi
  if [ "${SLURM_CI_KEEP:-0}" = 1 ]; then log "kept $D"; else rm -rf "$D"; fi
  log "down"
}

up() {
  local t0; t0=$(date +%s.%N)
  install_pkgs || { log "package install failed"; return 1; }
  [ -d "$D" ] && { log "previous $D found: tearing it down first"; SLURM_CI_KEEP=0 down; }
  mkdir -p "$D"/{etc,state,log,run,munge} && chmod 755 "$D" "$D/munge"
  for i in $(seq 1 "$N"); do mkdir -p "$D/spool/node$i"; done
  write_conf
  printf 'export SLURM_CONF=%s\n' "$SLURM_CONF" > "$D/env.sh"
  # private munged (own key + socket): does not touch /etc/munge or /run/munge
  mungekey -c -k "$D/munge/munge.key" -b 1024 >/dev/null 2>&1 ||
    { dd if=/dev/urandom of="$D/munge/munge.key" bs=1024 count=1 2>/dev/null; chmod 600 "$D/munge/munge.key"; }
  env "$TAG" munged --socket="$D/munge/munge.sock" --key-file="$D/munge/munge.key" \
      --pid-file="$D/munge/munged.pid" --log-file="$D/munge/munged.log" \
      --seed-file="$D/munge/munged.seed" || { log "munged failed"; cat "$D/munge/munged.log" >&2; return 1; }
  env "$TAG" slurmctld -i || { log "slurmctld failed"; tail -20 "$D/log/slurmctld.log" >&2; return 1; }
  for i in $(seq 1 "$N"); do
    env "$TAG" slurmd -N "node$i" || { log "slurmd node$i failed"; tail -20 "$D/log/slurmd-node$i.log" >&2; return 1; }
  done
  local idle=0
  for i in $(seq 300); do
    idle=$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
    [ "$idle" -ge "$N" ] && break; sleep 0.1
  done
  [ "$idle" -ge "$N" ] || { log "only $idle/$N nodes idle after 30s"; sinfo -N >&2; return 1; }
  log "up: $N nodes idle in $(echo "$(date +%s.%N) - $t0" | bc)s; source $D/env.sh"
  echo "export SLURM_CONF=$SLURM_CONF"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) sinfo -N; squeue -s ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
