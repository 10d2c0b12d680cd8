#!/usr/bin/env bash
# A throw-away Slurm cluster on this host, for the slurm tests and for trying the sbatch templates.
#
#   scripts/services/start_slurm.sh start DIR [NODES]   install Debian's Slurm + munge if missing (needs root),
#                                              write DIR/slurm.conf, start munged, slurmctld and NODES
#                                              slurmd (default 1; names mx1..mxN, all on this host),
#                                              wait until sinfo shows every node idle
#   scripts/services/start_slurm.sh stop DIR            stop the daemons started for DIR
#
# Then: SLURM_CONF=DIR/slurm.conf sbatch ...    (prints `export SLURM_CONF=...` when started)
#
# Idempotent: a DIR whose daemons still run is left alone; everything (config, state, spool, logs,
# munge key and socket, pid files) lives in DIR, on free loopback ports, so several clusters can run
# side by side and nothing outside DIR changes — except the one-time apt-get install.
set -euo pipefail

# apt-get, one at a time: the test suite's set-up steps (Redis, Slurm, the CRIU kit) may install side by side,
# and a second apt-get fails at once on dpkg's lock
apt_get() { flock /tmp/mxlaunch-apt.lock apt-get -o DPkg::Lock::Timeout=600 "$@"; }


die() { echo "start_slurm: $*" >&2; exit 2; }

install_slurm() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null && return 0
  [ "$(id -u)" -eq 0 ] || die "Slurm is not installed and this is not root — run: sudo apt-get install slurmctld slurmd slurm-client munge"
  echo "start_slurm: installing slurmctld slurmd slurm-client munge (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt_get update -qq >&2
  apt_get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >&2
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

alive() {  # alive PIDFILE: the process named in PIDFILE runs
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

wait_for() {  # wait_for SECONDS WHAT CMD...: poll CMD until it succeeds
  local deadline=$((SECONDS + $1)) what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "start_slurm: timed out waiting for $what" >&2; return 1; }
    sleep 0.5
  done
}

all_idle() {  # every node of DIR's cluster answers and is idle
  local states
  states=$(SLURM_CONF="$DIR/slurm.conf" sinfo -h -N -o '%t' 2>/dev/null) || return 1
  [ -n "$states" ] && [ -z "$(echo "$states" | grep -v '^idle$')" ]
}

write_conf() {
  local nodes=$1 host ctld_port slurmd_port line
  host=$(hostname -s)
  ctld_port=$(free_port)
  # slurmd -C: the node's real CPU layout and memory (a mismatch would drain the node)
  line=$(slurmd -C | head -1)
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/munge"
  {
    echo "# written by scripts/services/start_slurm.sh"
    echo "ClusterName=mxlaunch"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmctldPort=$ctld_port"
    echo "SlurmUser=$(id -un)"
    echo "SlurmdUser=$(id -un)"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "AuthInfo=socket=$DIR/munge/munge.sock"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/slurmctld.log"
    echo "SlurmdLogFile=$DIR/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "SchedulerType=sched/backfill"
    echo "MpiDefault=none"
    echo "SwitchType=switch/none"
    echo "ReturnToService=2"
    echo "KillWait=15"
    echo "InactiveLimit=0"
    echo "MinJobAge=3600"
    echo "SlurmdTimeout=120"
    for i in $(seq 1 "$nodes"); do
      slurmd_port=$(free_port)
      echo "NodeName=mx$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$slurmd_port ${line#NodeName=* } State=UNKNOWN" \
        | sed 's/ UpTime=[^ ]*//'
    done
    echo "PartitionName=mx Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } >"$DIR/slurm.conf"
}

start() {
  local nodes=${1:-1}
  [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "NODES must be a whole number ≥ 1, got '$nodes'"
  install_slurm
  mkdir -p "$DIR"
  DIR=$(cd "$DIR" && pwd)
  if alive "$DIR/slurmctld.pid"; then
    wait_for 60 "nodes idle" all_idle
    echo "export SLURM_CONF=$DIR/slurm.conf"
    return 0
  fi
  [ -f "$DIR/slurm.conf" ] || write_conf "$nodes"
  nodes=$(grep -c '^NodeName=' "$DIR/slurm.conf")
  if ! alive "$DIR/munged.pid"; then
    [ -f "$DIR/munge.key" ] || { head -c 1024 /dev/urandom >"$DIR/munge.key"; chmod 600 "$DIR/munge.key"; }
    munged --force --socket="$DIR/munge/munge.sock" --key-file="$DIR/munge.key" --pid-file="$DIR/munged.pid" \
      --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed"
  fi
  export SLURM_CONF="$DIR/slurm.conf"
  slurmctld -c -f "$SLURM_CONF"
  wait_for 60 "slurmctld" scontrol ping
  for i in $(seq 1 "$nodes"); do
    alive "$DIR/slurmd-mx$i.pid" || slurmd -N "mx$i" -f "$SLURM_CONF"
  done
  wait_for 90 "nodes idle (see $DIR/slurmd-mx1.log)" all_idle
  echo "export SLURM_CONF=$DIR/slurm.conf"
}

stop_pid() {  # stop_pid PIDFILE: SIGTERM, wait up to 20 s, then SIGKILL
  alive "$1" || return 0
  local pid
  pid=$(cat "$1")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL "$pid" 2>/dev/null || true
}

stop() {
  [ -d "$DIR" ] || return 0
  local f
  for f in "$DIR"/slurmd-*.pid; do [ -e "$f" ] && stop_pid "$f"; done
  stop_pid "$DIR/slurmctld.pid"
  stop_pid "$DIR/munged.pid"
}

[ $# -ge 2 ] || die "usage: $0 start DIR [NODES] | stop DIR"
cmd=$1
DIR=$2
shift 2
case "$cmd" in
  start) start "$@" ;;
  stop) stop ;;
  *) die "unknown command '$cmd' (start or stop)" ;;
esac
