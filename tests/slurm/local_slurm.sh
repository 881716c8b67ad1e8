#!/bin/bash
# A throwaway single-node Slurm (munge + slurmctld + slurmd), all state in one temp dir, for the
# tests: the project's version of the shared recipe (recipes/local-slurm.sh).
#
#   local_slurm.sh start [ENV_FILE]   start it; write ENV_FILE (default ./slurm.env):
#                                     `export SLURM_CONF=...` and `export SLURM_TMP=...` lines
#   local_slurm.sh stop  [ENV_FILE]   cancel its jobs, stop the daemons, remove the temp dir and ENV_FILE
#
# Users of the instance source ENV_FILE (or read its lines) and then call sbatch, squeue, scontrol.
# Facts behind it (ENVIRONMENT.md): munge's socket dir must be mode 755; Debian's Open MPI under
# srun works only with --mpi=pmix; CPUs=4 with SlurmdParameters=config_overrides lets 4-rank jobs
# run on 2 cores. Ports are picked free (ss, else /proc/net/tcp; several instances may run on one machine); MinJobAge keeps
# finished jobs in `scontrol show job` for an hour (there is no accounting database).
# cred_expire=20 (default 120 s) is also how long a requeued job waits before it may start again
# (slurm.conf(5), AuthInfo): the requeue test's job resumes about 20-60 s after its first run ends.
set -uo pipefail

ACTION=${1:-}
ENV_FILE=${2:-${TESSERA_SLURM_ENV:-$PWD/slurm.env}}
case "$ENV_FILE" in /*) ;; *) ENV_FILE="$PWD/$ENV_FILE" ;; esac

log() { echo "local_slurm: $*" >&2; }

# Local TCP ports in use (any state), from ss or else from /proc.
used_ports() {
  if command -v ss >/dev/null; then
    ss -Htan 2>/dev/null | awk '{ n = split($4, a, ":"); print a[n] }'
  else
    local f local_address
    for f in /proc/net/tcp /proc/net/tcp6; do
      [ -r "$f" ] || continue
      tail -n +2 "$f" | while read -r _ local_address _; do echo $((16#${local_address##*:})); done
    done
  fi | sort -u
}

# Two free TCP ports n, n+1 in 20000-31999, below the ephemeral range Linux hands out to clients
# (32768-60999), with nothing listening or connected on them.
pick_ports() {
  local used n tries
  used=$(used_ports)
  for tries in $(seq 1 200); do
    n=$((20000 + (RANDOM * 32768 + RANDOM) % 11999))
    if ! grep -qx "$n" <<<"$used" && ! grep -qx "$((n + 1))" <<<"$used"; then
      echo "$n"
      return 0
    fi
  done
  return 1
}

# Ends the instance described by the env file (whatever part of it got started).
stop_instance() {
  [ -f "$ENV_FILE" ] || return 0
  local SLURM_CONF="" SLURM_TMP=""
  # shellcheck disable=SC1090
  . "$ENV_FILE"
  export SLURM_CONF
  if [ -n "$SLURM_CONF" ] && [ -f "$SLURM_CONF" ] && [ -f "$SLURM_TMP/slurmctld.pid" ]; then
    # Cancel whatever still runs, so no job step outlives its slurmd.
    local jobs
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
      # shellcheck disable=SC2086
      timeout 10 scancel $jobs 2>/dev/null
      for _ in $(seq 1 100); do
        [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.1
      done
    fi
  fi
  local f p
  for f in "$SLURM_TMP/slurmd.pid" "$SLURM_TMP/slurmctld.pid" "$SLURM_TMP/munge/munged.pid"; do
    [ -f "$f" ] || continue
    p=$(cat "$f" 2>/dev/null)
    [ -n "$p" ] || continue
    kill "$p" 2>/dev/null
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$p" 2>/dev/null && kill -9 "$p" 2>/dev/null
  done
  case "$SLURM_TMP" in
    "${TMPDIR:-/tmp}"/tessera-slurm.*) rm -rf "$SLURM_TMP" ;;
  esac
  rm -f "$ENV_FILE"
}

start_once() {
  local S H port
  S=$(mktemp -d "${TMPDIR:-/tmp}/tessera-slurm.XXXXXX") || return 1
  chmod 755 "$S"  # munged: the socket dir must be a+x (mktemp gives 0700)
  mkdir -p "$S"/{munge,log,ctld,d,tmp}
  printf 'export SLURM_CONF=%s\nexport SLURM_TMP=%s\n' "$S/slurm.conf" "$S" >"$ENV_FILE"
  H=$(hostname -s)
  port=$(pick_ports) || { log "no free ports"; return 1; }
  mungekey --create --keyfile="$S/munge/munge.key" >/dev/null 2>&1 || { log "mungekey failed"; return 1; }
  munged --key-file="$S/munge/munge.key" --socket="$S/munge/munge.socket.2" \
    --pid-file="$S/munge/munged.pid" --log-file="$S/log/munged.log" \
    --seed-file="$S/munge/munged.seed" || { log "munged failed; see $S/log/munged.log"; return 1; }
  cat >"$S/slurm.conf" <<CONF
ClusterName=tessera
SlurmctldHost=$H
SlurmUser=$(id -un)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$S/munge/munge.socket.2,cred_expire=20
StateSaveLocation=$S/ctld
SlurmdSpoolDir=$S/d
TmpFS=$S/tmp
SlurmctldPidFile=$S/slurmctld.pid
SlurmdPidFile=$S/slurmd.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd.log
SlurmctldPort=$port
SlurmdPort=$((port + 1))
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmix
ReturnToService=2
MinJobAge=3600
KillWait=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
NodeName=$H CPUs=${SLURM_CPUS:-4} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=$H Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  export SLURM_CONF="$S/slurm.conf"
  slurmctld -f "$SLURM_CONF" || { log "slurmctld failed; see $S/log/slurmctld.log"; return 1; }
  slurmd -f "$SLURM_CONF" || { log "slurmd failed; see $S/log/slurmd.log"; return 1; }
  for _ in $(seq 1 120); do
    [ "$(sinfo -h -o %T 2>/dev/null)" = idle ] && { log "up: SLURM_CONF=$SLURM_CONF (ports $port, $((port + 1)))"; return 0; }
    sleep 0.25
  done
  log "slurm did not come up within 30 s; logs:"
  tail -n 20 "$S"/log/*.log >&2
  return 1
}

case "$ACTION" in
  start)
    for tool in mungekey munged slurmctld slurmd sinfo squeue scontrol sbatch scancel; do
      command -v "$tool" >/dev/null || PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null ||
        { log "'$tool' is not installed (Debian: apt-get install slurm-wlm munge)"; exit 1; }
    done
    export PATH="$PATH:/usr/sbin:/sbin"
    stop_instance  # a previous run that was never stopped
    for attempt in 1 2 3; do
      start_once && exit 0
      log "attempt $attempt failed"
      stop_instance
    done
    exit 1
    ;;
  stop)
    stop_instance
    exit 0
    ;;
  *)
    echo "usage: $0 start|stop [ENV_FILE]" >&2
    exit 2
    ;;
esac
