#!/usr/bin/env bash
# A Ray cluster of several hosts on this one machine, for tests and for trying cpr across hosts.
#
#   scripts/local_cluster.sh up            head (host 0) + CPR_CLUSTER_HOSTS-1 worker hosts
#   scripts/local_cluster.sh exec N -- CMD run CMD on host N (its network, PID and mount namespaces)
#   scripts/local_cluster.sh kill-host N   SIGKILL every process of host N at once (a host's loss)
#   scripts/local_cluster.sh add-host N    start host N again (a fresh host: empty local disk)
#   scripts/local_cluster.sh partition N S cut host N's link for S seconds, then restore it
#   scripts/local_cluster.sh link N down|up cut or restore host N's link (until told otherwise)
#   scripts/local_cluster.sh ray-alive N   exit 0 if host N's Ray node still runs (after a partition,
#                                          Ray has declared it dead and its raylet exits)
#   scripts/local_cluster.sh status        hosts, their init pids and Ray's view of the nodes
#   scripts/local_cluster.sh netns         the network namespaces the cluster is made of
#   scripts/local_cluster.sh down          stop everything and remove namespaces and files
#
# Each host is a network namespace with its own address (10.77.0.10 + N, on a bridge that
# lives in a namespace of its own: nothing is added to this machine's network) and its own
# PID namespace, whose init (scripts/host_init.py) starts the host's Ray node. Killing that
# init kills the host; `ray stop` only ever runs inside a host's PID namespace, never here
# (it would stop every Ray instance on the machine).
#
# Every host sees this machine's files (the shared storage: put cache_dir and run_dir there)
# and has a private tmpfs at $CPR_CLUSTER_DIR/local (storage no other host sees).
#
# Settings (environment): CPR_CLUSTER_DIR (default /tmp/cpr-cluster), CPR_CLUSTER_HOSTS (3),
# CPR_HEAD_CPUS (0: the head runs the driver, supervisor and controllers, no trainers or
# shards), CPR_WORKER_CPUS (6), CPR_OBJECT_STORE_MB (80), CPR_PYTHON (.venv/bin/python),
# CPR_CLUSTER_OWNER (a pid: a later `up` tears this cluster down once that process is gone,
# so that an interrupted test leaves nothing behind).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${CPR_CLUSTER_DIR:-/tmp/cpr-cluster}"
HOSTS="${CPR_CLUSTER_HOSTS:-3}"
PYTHON="${CPR_PYTHON:-$ROOT/.venv/bin/python}"
RAY="$(dirname "$PYTHON")/ray"
REGISTRY=/run/cpr-clusters
SUBNET=10.77.0
PORT=6379

die() { echo "local_cluster.sh: $*" >&2; exit 1; }
# What a caller's environment must not pass to the hosts: a local Ray's loopback settings
# (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes a worker refuse to join), another cluster's
# address, a gloo interface of this machine.
SCRUB=(-u GLOO_SOCKET_IFNAME -u RAY_ADDRESS -u RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER)
tag_of() { printf '%s' "$1" | sha1sum | cut -c1-6; }
TAG="$(tag_of "$DIR")"
ns() { echo "cpr-$TAG-$1"; }
host_ip() { echo "$SUBNET.$((10 + $1))"; }
init_pid() { local f="$DIR/h$1/init.pid"; [[ -s $f ]] && kill -0 "$(cat "$f")" 2>/dev/null && cat "$f"; }

ray_env() {
  echo RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$DIR/auth_token" RAY_ADDRESS="$(host_ip 0):$PORT"
}

reap_stale() {
  # Clusters whose owner process is gone (a test killed before its teardown).
  [[ -d $REGISTRY ]] || return 0
  local entry owner dir
  for entry in "$REGISTRY"/*; do
    [[ -f $entry ]] || continue
    owner="$(sed -n 2p "$entry")"; dir="$(sed -n 1p "$entry")"
    if [[ -n $owner ]] && ! kill -0 "$owner" 2>/dev/null; then
      echo "local_cluster.sh: tearing down $dir (its owner $owner is gone)" >&2
      CPR_CLUSTER_DIR="$dir" "$0" down || true
    fi
  done
}

make_network() {
  ip netns add "$(ns br)" || die "cannot create network namespaces (needs root and CAP_SYS_ADMIN; 'ip netns add' failed)"
  ip -n "$(ns br)" link add br0 type bridge
  ip -n "$(ns br)" link set br0 up
  local n
  for ((n = 0; n < HOSTS; n++)); do
    ip netns add "$(ns h$n)"
    ip -n "$(ns h$n)" link add eth0 type veth peer name "h$n" netns "$(ns br)"
    ip -n "$(ns br)" link set "h$n" master br0 up
    ip -n "$(ns h$n)" addr add "$(host_ip "$n")/24" dev eth0
    ip -n "$(ns h$n)" link set eth0 up
    ip -n "$(ns h$n)" link set lo up
  done
}

start_host() {
  local n=$1 ip; ip="$(host_ip "$n")"
  [[ -z "$(init_pid "$n")" ]] || die "host $n is already up"
  ip netns list | grep -q "^$(ns h$n)\b" || die "host $n has no namespace (was the cluster brought up?)"
  mkdir -p "$DIR/h$n/ray"
  local common=(--node-ip-address="$ip" --temp-dir="$DIR/h$n/ray" --object-store-memory=$(( ${CPR_OBJECT_STORE_MB:-80} * 1024 * 1024 ))
                --disable-usage-stats)
  # As cpr's embedded Ray (app.job.ray_system_config): a shard's answer up to 1 MB travels
  # inside the call instead of through the object store.
  local cmd env=(RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$DIR/auth_token" RAY_max_direct_call_object_size=1048576)
  if ((n == 0)); then
    cmd=("$RAY" start --head --port=$PORT --num-cpus="${CPR_HEAD_CPUS:-0}" --dashboard-host="$ip" "${common[@]}")
    # Ray declares a lost host dead after about 1.5 s instead of about 15 s.
    env+=(RAY_health_check_period_ms=500 RAY_health_check_timeout_ms=500 RAY_health_check_failure_threshold=3)
  else
    cmd=("$RAY" start --address="$(host_ip 0):$PORT" --num-cpus="${CPR_WORKER_CPUS:-6}" "${common[@]}")
  fi
  : > "$DIR/h$n/init.log"
  setsid env "${SCRUB[@]}" "${env[@]}" ip netns exec "$(ns h$n)" unshare --pid --fork --mount-proc --kill-child \
    "$PYTHON" "$ROOT/scripts/host_init.py" --local-dir "$DIR/local" --ray "$RAY" -- "${cmd[@]}" \
    >> "$DIR/h$n/init.log" 2>&1 < /dev/null &
  local unshare_pid=$! init="" t
  for ((t = 0; t < 50; t++)); do
    init="$(pgrep -P "$unshare_pid" || true)"; [[ -n $init ]] && break; sleep 0.1
  done
  [[ -n $init ]] || die "host $n: its init did not start (see $DIR/h$n/init.log)"
  echo "$init" > "$DIR/h$n/init.pid"
  for ((t = 0; t < 1200; t++)); do
    grep -q '^ready$' "$DIR/h$n/init.log" && return 0
    kill -0 "$init" 2>/dev/null || die "host $n: Ray did not start: $(tail -5 "$DIR/h$n/init.log")"
    sleep 0.1
  done
  die "host $n: Ray did not start within 120 s (see $DIR/h$n/init.log)"
}

stop_host() {
  # SIGTERM: the init runs `ray stop --force` inside the host; SIGKILL after 3 s (the
  # kernel then kills every process of the host's PID namespace).
  local n=$1 pid t
  pid="$(init_pid "$n" || true)"; [[ -n $pid ]] || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((t = 0; t < 30; t++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  for ((t = 0; t < 50; t++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  rm -f "$DIR/h$n/init.pid"
}

case "${1:-}" in
  up)
    [[ $HOSTS -ge 2 && $HOSTS -le 9 ]] || die "CPR_CLUSTER_HOSTS=$HOSTS: allowed 2..9"
    [[ -x $RAY ]] || die "no ray at $RAY (run ./dev.sh setup, or set CPR_PYTHON)"
    reap_stale
    ip netns list | grep -q "^$(ns br)\b" && die "a cluster is already up at $DIR (run: $0 down)"
    # A host that fails to start takes the half-made cluster down with it.
    trap 'rc=$?; if ((rc != 0)); then echo "local_cluster.sh: up failed; tearing down" >&2; "$0" down; fi' EXIT
    mkdir -p "$DIR" "$REGISTRY"
    printf '%s\n%s\n' "$DIR" "${CPR_CLUSTER_OWNER:-}" > "$REGISTRY/$TAG"
    echo "$HOSTS" > "$DIR/hosts"
    printf 'CPR_WORKER_CPUS=%q\nCPR_HEAD_CPUS=%q\nCPR_OBJECT_STORE_MB=%q\n' "${CPR_WORKER_CPUS:-6}" \
      "${CPR_HEAD_CPUS:-0}" "${CPR_OBJECT_STORE_MB:-80}" > "$DIR/settings"
    [[ -s $DIR/auth_token ]] || "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' > "$DIR/auth_token"
    chmod 600 "$DIR/auth_token"
    make_network
    for ((n = 0; n < HOSTS; n++)); do start_host "$n"; done
    echo "cluster up: $HOSTS hosts, head at $(host_ip 0):$PORT; driver env: $(ray_env)"
    ;;
  exec)
    n="${2:?host number}"; shift 2; [[ ${1:-} == -- ]] && shift
    pid="$(init_pid "$n")" || die "host $n is not up"
    # shellcheck disable=SC2046
    exec nsenter --target "$pid" --net --pid --mount --wd="$PWD" -- env "${SCRUB[@]}" $(ray_env) "$@"
    ;;
  kill-host)
    n="${2:?host number}"; pid="$(init_pid "$n")" || die "host $n is not up"
    kill -KILL "$pid"
    python3 -c 'import time; print(f"host '"$n"' killed at {time.time():.3f}")'
    # Gone before it may start again: the kernel kills the rest of its PID namespace with it.
    for ((t = 0; t < 100; t++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    rm -f "$DIR/h$n/init.pid"
    ;;
  add-host)
    n="${2:?host number}"; HOSTS="$(cat "$DIR/hosts")"
    # The settings the cluster was brought up with, whatever the caller's environment says.
    # shellcheck disable=SC1091
    source "$DIR/settings"
    (( n > 0 && n < HOSTS )) || die "add-host $n: worker hosts are 1..$((HOSTS - 1))"
    start_host "$n"
    echo "host $n up at $(host_ip "$n")"
    ;;
  link)
    n="${2:?host number}"; state="${3:?down or up}"
    [[ $state == down || $state == up ]] || die "link $n $state: give down or up"
    ip -n "$(ns br)" link set "h$n" "$state" || die "host $n has no link (is the cluster up?)"
    python3 -c 'import time; print(f"host '"$n"' link '"$state"' at {time.time():.3f}")'
    ;;
  partition)
    n="${2:?host number}"; secs="${3:?seconds}"
    "$0" link "$n" down
    sleep "$secs"
    "$0" link "$n" up
    ;;
  ray-alive)
    n="${2:?host number}"; pid="$(init_pid "$n")" || exit 1
    # The host's raylet: a process of its PID namespace whose command is Ray's raylet.
    nsenter --target "$pid" --pid --mount -- pgrep -f '/raylet/raylet ' > /dev/null
    ;;
  netns)
    HOSTS="$(cat "$DIR/hosts" 2>/dev/null)" || die "no cluster at $DIR"
    ns br; for ((n = 0; n < HOSTS; n++)); do ns "h$n"; done
    ;;
  status)
    HOSTS="$(cat "$DIR/hosts" 2>/dev/null)" || die "no cluster at $DIR"
    for ((n = 0; n < HOSTS; n++)); do echo "host $n $(host_ip "$n") init=$(init_pid "$n" || echo down)"; done
    ;;
  down)
    if [[ -f $DIR/hosts ]]; then HOSTS="$(cat "$DIR/hosts")"; fi
    for ((n = HOSTS - 1; n >= 0; n--)); do stop_host "$n" & done
    wait
    for ((n = 0; n < HOSTS; n++)); do ip netns del "$(ns h$n)" 2>/dev/null || true; done
    ip netns del "$(ns br)" 2>/dev/null || true
    rm -f "$REGISTRY/$TAG"
    [[ ${CPR_CLUSTER_KEEP:-0} == 1 ]] || rm -rf "$DIR"
    left="$(ip netns list | grep -o "^cpr-$TAG-[^ ]*" || true)"
    [[ -z $left ]] || die "down left network namespaces: $(echo $left)"
    ;;
  *)
    sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
