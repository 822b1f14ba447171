#!/usr/bin/env bash
# A real Slurm cluster on this one machine, emulating 3 nodes: node1 and node2 (partition
# debug, the default) for trying the SLURM path on a laptop and for the SLURM tests, and node3
# alone in partition faults, which a test may take down without touching the others' jobs.
# Needs root and Debian's packages.
#   scripts/slurm-local.sh up | down | status
# Debian's Slurm is built with multiple-slurmd support, so `slurmd -N nodeX` daemons run
# side by side on distinct ports. No accounting database: submitit's sacct calls fail and it
# falls back to squeue.
#
# `up` may be run again on a running cluster (twice, thrice): it leaves a cluster that runs
# jobs. An unchanged configuration is not written again and nothing is restarted; a changed
# one (SLURM_LOCAL_CPUS ...) restarts the controller and the nodes on it, keeping the jobs (a
# job on a node whose size changed is requeued). Missing spool folders are made again.
#
# SLURM_LOCAL_ROOT=DIR keeps a second, separate cluster under DIR (its configuration, state,
# spool folders, logs and pid files; SLURM_LOCAL_PORT its controller's port, its nodes on the
# ports after SLURM_LOCAL_NODE_PORT): its commands need SLURM_CONF=DIR/slurm.conf. The tests
# use one to run `up` twice without touching the cluster other tests run jobs on.
set -euo pipefail

NODES=(node1 node2 node3)
CPUS=${SLURM_LOCAL_CPUS:-16}       # CPUs each emulated node offers (they share the real ones)
MEM_MB=${SLURM_LOCAL_MEM_MB:-32000} # memory each emulated node offers (not enforced)
MAX_ARRAY_SIZE=${SLURM_LOCAL_MAX_ARRAY_SIZE:-4}  # jobs one array may hold
ROOT=${SLURM_LOCAL_ROOT:-}
PORT=${SLURM_LOCAL_PORT:-6817}
NODE_PORT=${SLURM_LOCAL_NODE_PORT:-17001}  # node1's; node2 and node3 take the next ones
if [ -n "$ROOT" ]; then
  CONF=$ROOT/slurm.conf STATE=$ROOT/slurmctld SPOOL=$ROOT/slurmd LOGS=$ROOT/log PIDS=$ROOT/run
  export SLURM_CONF=$CONF  # (for this script's own scontrol and sinfo)
else
  CONF=/etc/slurm/slurm.conf STATE=/var/spool/slurmctld SPOOL=/var/spool/slurmd
  LOGS=/var/log/slurm PIDS=/run
fi

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

config_text() {
  local host port=$NODE_PORT
  host=$(hostname -s)
  cat <<EOF
# Written by app's scripts/slurm-local.sh: one machine, three emulated nodes.
ClusterName=applocal
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
SlurmctldPort=${PORT}
StateSaveLocation=${STATE}
SlurmdSpoolDir=${SPOOL}-%n
SlurmctldPidFile=${PIDS}/slurmctld.pid
SlurmdPidFile=${PIDS}/slurmd-%n.pid
SlurmctldLogFile=${LOGS}/slurmctld.log
SlurmdLogFile=${LOGS}/slurmd-%n.log
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
EOF
  for node in "${NODES[@]}"; do
    echo "NodeName=${node} NodeHostname=${host} NodeAddr=127.0.0.1 Port=${port} CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN"
    port=$((port + 1))
  done
  cat <<EOF
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
PartitionName=faults Nodes=node3 Default=NO MaxTime=INFINITE State=UP
EOF
}

# Writes the configuration when it differs from the one in place; says whether it did.
write_config() {
  local text
  text=$(config_text)
  mkdir -p "$(dirname "$CONF")" "$STATE" "$LOGS" "$PIDS"
  # Each node's spool folder: slurmd makes it only when it starts, and fails every job
  # launched without it ("launch failed requeued held").
  for node in "${NODES[@]}"; do mkdir -p "${SPOOL}-${node}"; done
  # Node names must resolve: tasks use the first node's name as the rendezvous address.
  for node in "${NODES[@]}"; do
    grep -qE "^127\.0\.0\.1[[:space:]].*\b${node}\b" /etc/hosts || echo "127.0.0.1 ${node}" >> /etc/hosts
  done
  if [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$text" ]; then
    return 1
  fi
  printf '%s\n' "$text" > "$CONF.new" && mv "$CONF.new" "$CONF"
}

# Liveness by function, not by process name: a killed daemon can linger as a zombie that
# pgrep still lists, and another cluster's daemons (SLURM_LOCAL_ROOT) have the same names.
munge_works() { munge -n </dev/null >/dev/null 2>&1; }
controller_up() { timeout 10 scontrol ping 2>/dev/null | grep -q "is UP"; }
# The pid in a daemon's pid file, when that process lives and is that daemon (not a zombie).
running_pid() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qE "^([^ ]*/)?$2( |$)" || return 1
  [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ] || return 1
  echo "$pid"
}
# Ends one daemon of this cluster (by its pid file) and waits until it is gone.
stop_daemon() {
  local pid
  pid=$(running_pid "$1" "$2") || { rm -f "$1"; return 0; }
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 40); do running_pid "$1" "$2" >/dev/null || break; sleep 0.25; done
  running_pid "$1" "$2" >/dev/null && kill -9 "$pid" 2>/dev/null || true
  rm -f "$1"
}

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
  local changed=0
  write_config && changed=1
  start_munge
  if controller_up; then
    if [ "$changed" = 1 ]; then
      # A changed configuration (a node's CPUs, MaxArraySize): the controller and the nodes
      # start again from it, keeping their jobs (no -c; a job on a node whose size changed is
      # requeued). Not `scontrol reconfigure`: the controller refuses node changes that way,
      # and a slurmd that reads a changed configuration again does not make the spool folder
      # it names, so that it fails every job it is given ("launch failed requeued held").
      echo "slurm-local: the configuration changed: restarting the controller and the nodes"
      for node in "${NODES[@]}"; do stop_daemon "$PIDS/slurmd-$node.pid" "slurmd -N $node"; done
      timeout 10 scontrol shutdown slurmctld >/dev/null 2>&1 || true
      for _ in $(seq 40); do controller_up || break; sleep 0.25; done
      stop_daemon "$PIDS/slurmctld.pid" slurmctld
      slurmctld -f "$CONF"
    fi  # (else the same cluster, running: nothing to restart)
  else
    # A fresh controller starts with its saved state cleared (-c): jobs left in
    # StateSaveLocation by an earlier cluster (a reboot, a killed CI run) would otherwise hold
    # the nodes ALLOCATED and never release them, since nothing runs them any more.
    stop_daemon "$PIDS/slurmctld.pid" slurmctld
    slurmctld -c -f "$CONF"
  fi
  for node in "${NODES[@]}"; do
    running_pid "$PIDS/slurmd-$node.pid" "slurmd -N $node" >/dev/null || slurmd -N "$node" -f "$CONF"
  done
  # Ready when every node answers and none is down or drained: busy nodes (alloc, mix: a job
  # is running) are ready too.
  for _ in $(seq 60); do
    local states
    states=$(timeout 10 sinfo -h -o '%t' 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "$states" ] && [ -z "$(echo "$states" | tr ' ' '\n' | grep -vxE 'idle|mix|alloc|comp|')" ]; then
      echo "slurm-local: up"; sinfo; return 0
    fi
    timeout 10 scontrol update nodename="$(IFS=,; echo "${NODES[*]}")" state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  echo "slurm-local: nodes did not become ready:" >&2
  sinfo >&2 || true
  tail -20 "$LOGS/slurmctld.log" >&2 || true
  exit 1
}

down() {
  need_root
  controller_up && scancel --user=root >/dev/null 2>&1 || true
  for node in "${NODES[@]}"; do stop_daemon "$PIDS/slurmd-$node.pid" "slurmd -N $node"; done
  stop_daemon "$PIDS/slurmctld.pid" slurmctld
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
