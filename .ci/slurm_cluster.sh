#!/usr/bin/env bash
# A REAL Slurm cluster of two fake nodes (n1, n2) on this one host, for CI and for trying the sbatch scripts.
#
#   .ci/slurm_cluster.sh start    # install (only what is missing), configure, start munged/slurmctld/2x slurmd
#   .ci/slurm_cluster.sh status   # sinfo
#   .ci/slurm_cluster.sh stop     # scontrol shutdown, then stop munged if we started it
#   .ci/slurm_cluster.sh env      # print the exports a shell needs (SLURM_CONF, DPPO_SLURM_CLUSTER, ...)
#
# Debian bookworm's Slurm 22.05 runs several slurmd on one host: each fake node has its own port, spool and TmpFS
# directory; SlurmdParameters=config_overrides lets a small box claim 8 CPUs and 8 GPUs per node; the "GPUs" are
# character devices (mknod ... c 1 3, i.e. /dev/null) listed in gres.conf, so Slurm sets CUDA_VISIBLE_DEVICES.
# There is no slurmdbd (no sacct); finished jobs stay visible in squeue/scontrol for MinJobAge seconds and are
# logged to $DPPO_SLURM_ROOT/jobcomp.txt. Needs root (apt-get, mknod, /etc/hosts, munged).
#
# Environment: DPPO_SLURM_ROOT (default /tmp/dppo-slurm): all state, logs and config live there.
set -euo pipefail

ROOT="${DPPO_SLURM_ROOT:-/tmp/dppo-slurm}"
CONF="$ROOT/etc/slurm.conf"
NODES=(n1 n2)
CPUS_PER_NODE=8
GPUS_PER_NODE=8
CTLD_PORT=16817
HOSTS_TAG="# dppo-slurm fake nodes"
MUNGE_PID=/run/munge/munged.pid
PACKAGES=(slurmctld slurmd slurm-client munge libpmix-dev openmpi-bin shellcheck)

log() { printf '[slurm_cluster] %s\n' "$*" >&2; }

install_missing() {
    local missing=() pkg
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    if ((${#missing[@]} == 0)); then
        return
    fi
    if ((EUID != 0)); then
        log "missing packages ${missing[*]} and not root: install them with apt-get first"
        exit 1
    fi
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

write_config() {
    local host
    host="$(hostname)"
    mkdir -p "$ROOT/etc" "$ROOT/state" "$ROOT/log" "$ROOT/dev"
    local n
    for n in "${NODES[@]}"; do
        mkdir -p "$ROOT/spool-$n" "$ROOT/tmp-$n"
    done
    local i
    for ((i = 0; i < GPUS_PER_NODE; i++)); do
        [[ -c "$ROOT/dev/nvidia$i" ]] || mknod "$ROOT/dev/nvidia$i" c 1 3
    done
    cat >"$CONF" <<EOF
# Written by .ci/slurm_cluster.sh: two fake nodes on $host.
ClusterName=dppo
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool-%n
TmpFS=$ROOT/tmp-%n
SlurmctldPidFile=$ROOT/slurmctld.pid
SlurmdPidFile=$ROOT/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
MpiDefault=none
JobCompType=jobcomp/filetxt
JobCompLoc=$ROOT/jobcomp.txt
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SchedulerType=sched/backfill
# Fast turnaround for tests: a requeued job waits cred_expire seconds (default 120) before it may start again,
# and the schedulers look at pending jobs every few seconds instead of every 30/60 s. Failing jobs are killed
# 5 s after SIGTERM; finished jobs stay visible in squeue/scontrol for 15 minutes (there is no sacct).
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=2,bf_interval=2
KillWait=5
MinJobAge=900
InactiveLimit=0
MessageTimeout=10
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=$CPUS_PER_NODE Gres=gpu:$GPUS_PER_NODE RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$ROOT/etc/gres.conf" <<EOF
NodeName=n[1-2] Name=gpu File=$ROOT/dev/nvidia[0-$((GPUS_PER_NODE - 1))]
EOF
        cat >"$ROOT/env.sh" <<EOF
export SLURM_CONF=$CONF
export DPPO_SLURM_CLUSTER=1
export DPPO_SLURM_ROOT=$ROOT
EOF
}

add_hosts() {
    # n1/n2 must resolve (MASTER_ADDR is the first node name). Rewrite in place: /etc/hosts may be a bind mount.
    if ! grep -q "$HOSTS_TAG" /etc/hosts; then
        printf '127.0.0.1 %s %s\n' "${NODES[*]}" "$HOSTS_TAG" >>/etc/hosts
    fi
}

remove_hosts() {
    if grep -q "$HOSTS_TAG" /etc/hosts; then
        local kept
        kept="$(grep -v "$HOSTS_TAG" /etc/hosts)"
        printf '%s\n' "$kept" >/etc/hosts
    fi
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    # Check the pid, not `munge -n`: with no daemon the munge client retries for ~10 s before failing.
    if pid_alive "$MUNGE_PID"; then
        return
    fi
    [[ -s /etc/munge/munge.key ]] || { mungekey --create --force >/dev/null 2>&1 || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged
    touch "$ROOT/munged.ours"
    local t
    for t in $(seq 50); do
        munge_ok && return
        sleep 0.1
    done
    log "munged did not come up"
    exit 1
}

cluster_up() { SLURM_CONF="$CONF" timeout 5 sinfo -h >/dev/null 2>&1; }

pid_alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    install_missing
    if pid_alive "$ROOT/slurmctld.pid" && cluster_up; then
        log "already up; source $ROOT/env.sh"
        return
    fi
    write_config
    rm -f "$ROOT"/log/*.log "$ROOT/jobcomp.txt"
    add_hosts
    # Plain `sinfo` works without SLURM_CONF when /etc/slurm/slurm.conf is ours (a link); never replace a real one.
    if [[ ! -e /etc/slurm/slurm.conf || -L /etc/slurm/slurm.conf ]]; then
        mkdir -p /etc/slurm
        ln -sfn "$CONF" /etc/slurm/slurm.conf
    fi
    start_munge
    export SLURM_CONF="$CONF"
    pid_alive "$ROOT/slurmctld.pid" || slurmctld
    local n
    for n in "${NODES[@]}"; do
        pid_alive "$ROOT/slurmd-$n.pid" || slurmd -N "$n"
    done
    local t idle
    for t in $(seq 100); do
        idle="$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle$' || true)"
        if [[ "$idle" == "${#NODES[@]}" ]]; then
            log "up: ${#NODES[@]} nodes idle after $((t / 5)) s; source $ROOT/env.sh"
            return
        fi
        if ((t % 25 == 0)); then
            scontrol update nodename=n[1-2] state=resume >/dev/null 2>&1 || true
        fi
        sleep 0.2
    done
    log "nodes did not become idle:"
    sinfo -N >&2 || true
    tail -n 20 "$ROOT/log/slurmctld.log" >&2 || true
    exit 1
}

stop() {
    export SLURM_CONF="$CONF"
    if [[ -f "$CONF" ]]; then
        scancel --quiet --full "--user=$(id -un)" >/dev/null 2>&1 || true
        scontrol shutdown >/dev/null 2>&1 || true
    fi
    local f t
    for f in "$ROOT/slurmctld.pid" "$ROOT"/slurmd-*.pid; do
        [[ -e "$f" ]] || continue
        for t in $(seq 50); do
            pid_alive "$f" || break
            sleep 0.1
        done
        if pid_alive "$f"; then
            kill -9 "$(cat "$f")" 2>/dev/null || true
        fi
        rm -f "$f"
    done
    if [[ -e "$ROOT/munged.ours" && -s "$MUNGE_PID" ]]; then
        kill "$(cat "$MUNGE_PID")" 2>/dev/null || true
        rm -f "$ROOT/munged.ours"
    fi
    if [[ -L /etc/slurm/slurm.conf ]]; then
        rm -f /etc/slurm/slurm.conf
    fi
    remove_hosts
    # forget queued jobs so that the next start is clean
    rm -rf "$ROOT/state" "$ROOT"/spool-* "$ROOT"/tmp-*
    log "stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) SLURM_CONF="$CONF" sinfo ;;
    env) cat "$ROOT/env.sh" ;;
    up) cluster_up ;;
    *)
        echo "usage: $0 start|stop|status|env|up" >&2
        exit 2
        ;;
esac
