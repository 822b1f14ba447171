#!/usr/bin/env bash
# A real Slurm cluster on this one machine, emulating 3 nodes: node1 and node2 (partition
# debug, the default) for trying the SLURM path on a laptop and for the SLURM tests, and node3
# alone in partition faults, which a test may take down without touching the others' jobs.
# Needs root and Debian's packages.
#   scripts/slurm-local.sh up | down | status
# Debian's Slurm is built with multiple-slurmd support, so `slurmd -N nodeX` daemons run
# side by side on distinct ports. No accounting database: submitit's sacct calls fail and it
# falls back to squeue.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
NODES=(node1 node2 node3)
CPUS=${SLURM_LOCAL_CPUS:-16}       # CPUs each emulated node offers (they share the real ones)
MEM_MB=${SLURM_LOCAL_MEM_MB:-32000} # memory each emulated node offers (not enforced)
MAX_ARRAY_SIZE=${SLURM_LOCAL_MAX_ARRAY_SIZE:-4}  # jobs one array may hold

need_root() {
  [ "$(id -u)" = 0 ] || { echo "slurm-local: needs root (it installs packages and starts daemons)" >&2; exit 1; }
}

install_packages() {
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
      || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    echo "slurm-local: installing slurmctld slurmd slurm-client munge"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
  fi
}

write_config() {
  local host
  host=$(hostname -s)
  mkdir -p /etc/slurm /var/spool/slurmctld /var/log/slurm
  cat > "$CONF" <<EOF
# Written by app's scripts/slurm-local.sh: one machine, three emulated nodes.
ClusterName=applocal
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
SlurmctldPort=6817
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd-%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
# Small, so that the tests see a sweep split into arrays that fit (Slurm's default: 1001).
MaxArraySize=${MAX_ARRAY_SIZE}
NodeName=node1 NodeHostname=${host} NodeAddr=127.0.0.1 Port=17001 CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN
NodeName=node2 NodeHostname=${host} NodeAddr=127.0.0.1 Port=17002 CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN
NodeName=node3 NodeHostname=${host} NodeAddr=127.0.0.1 Port=17003 CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
PartitionName=faults Nodes=node3 Default=NO MaxTime=INFINITE State=UP
EOF
  # Node names must resolve: tasks use the first node's name as the rendezvous address.
  for node in "${NODES[@]}"; do
    grep -qE "^127\.0\.0\.1[[:space:]].*\b${node}\b" /etc/hosts || echo "127.0.0.1 ${node}" >> /etc/hosts
  done
}

# Liveness by function, not by process name: a killed daemon can linger as a zombie that
# pgrep still lists.
munge_works() { munge -n </dev/null >/dev/null 2>&1; }
controller_up() { timeout 10 scontrol ping 2>/dev/null | grep -q "is UP"; }

start_munge() {
  if ! munge_works; then
    rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    [ -s /etc/munge/munge.key ] || mungekey --create --force
    chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 20); do munge_works && return 0; sleep 0.5; done
    echo "slurm-local: munged did not start; see /var/log/munge/munged.log" >&2
    exit 1
  fi
}

up() {
  need_root
  install_packages
  write_config
  start_munge
  # A fresh controller starts with its saved state cleared (-c): jobs left in
  # StateSaveLocation by an earlier cluster (a reboot, a killed CI run) would otherwise hold
  # the nodes ALLOCATED and never release them, since nothing runs them any more.
  # A controller already up reads the configuration again (a changed MaxArraySize); one that
  # lacks a node of this configuration (an older cluster of two) starts again.
  if controller_up && timeout 10 scontrol show node node3 >/dev/null 2>&1; then
    scontrol reconfigure >/dev/null
  else
    pkill -x slurmctld || true
    for _ in $(seq 20); do pgrep -x slurmctld >/dev/null || break; sleep 0.5; done
    rm -f /run/slurmctld.pid; slurmctld -c
  fi
  for node in "${NODES[@]}"; do
    pgrep -f "slurmd -N $node" >/dev/null || slurmd -N "$node"
  done
  for _ in $(seq 60); do
    if [ "$(timeout 10 sinfo -h -o '%t' 2>/dev/null | sort -u | tr -d '\n')" = "idle" ]; then
      echo "slurm-local: up"; sinfo; return 0
    fi
    timeout 10 scontrol update nodename=node[1-3] state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  echo "slurm-local: nodes did not become idle:" >&2
  sinfo >&2 || true
  tail -20 /var/log/slurm/slurmctld.log >&2 || true
  exit 1
}

down() {
  need_root
  scancel --user=root >/dev/null 2>&1 || true
  pkill -x slurmd || true
  pkill -x slurmctld || true
  echo "slurm-local: down"
}

status() {
  sinfo && squeue
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
