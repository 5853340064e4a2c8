#!/usr/bin/env bash
# Two `specengine serve` replicas on loopback behind nginx (docs/serving.md, "Several replicas").
#
#   SPECENGINE_API_KEY=sk-... docs/examples/replicas/serve-replicas.sh [serve options ...]
#
# The serve options go to both replicas (--target, --draft, --max-batch-size, --max-waiting, ...;
# none: the default pair). Each replica serves on its own port; nginx balances them on
# ROUTER_PORT. The script waits until both answer /health, then starts nginx, prints "ready" and
# stays until Ctrl-C or SIGTERM, which stops all three. A replica that stops is reported, and nginx
# goes on with the other; the script exits 1 when nginx or both replicas have stopped.
#
#   ROUTER_PORT    nginx's port (default 8000)
#   REPLICA_PORTS  the replicas' ports (default "8001 8002")
#   RUN_DIR        where logs, pids and nginx's files go (default: a new temporary folder)
#   SPECENGINE     the command that runs specengine (default: specengine)
#   READY_TIMEOUT  seconds a replica may take to load and warm up (default 600)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
router_port=${ROUTER_PORT:-8000}
read -r -a replica_ports <<< "${REPLICA_PORTS:-8001 8002}"
run_dir=${RUN_DIR:-$(mktemp -d -t specengine-replicas.XXXXXX)}
ready_timeout=${READY_TIMEOUT:-600}
read -r -a specengine <<< "${SPECENGINE:-specengine}"

if [ "${#replica_ports[@]}" -ne 2 ]; then
    echo "serve-replicas.sh: REPLICA_PORTS must name two ports (nginx.conf lists two servers), got '${REPLICA_PORTS}'" >&2
    exit 2
fi
for port in "$router_port" "${replica_ports[@]}"; do
    if ! [[ "$port" =~ ^[0-9]+$ ]] || [ "$port" -lt 1 ] || [ "$port" -gt 65535 ]; then
        echo "serve-replicas.sh: '$port' is not a port (1..65535)" >&2
        exit 2
    fi
done
command -v nginx > /dev/null || { echo "serve-replicas.sh: nginx not found (apt-get install nginx)" >&2; exit 2; }
command -v curl > /dev/null || { echo "serve-replicas.sh: curl not found (apt-get install curl)" >&2; exit 2; }
if [ -z "${SPECENGINE_API_KEY:-}" ]; then
    echo "serve-replicas.sh: warning: SPECENGINE_API_KEY is not set: the replicas serve without a key" >&2
    unset SPECENGINE_API_KEY  # set but empty would stop `serve` (an empty key is refused)
fi
mkdir -p "$run_dir/tmp"

pids=()
stop() {
    trap - EXIT INT TERM
    # nginx first, so no new request reaches a replica that is stopping; then the replicas, each
    # given its --shutdown-grace for its open requests.
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2> /dev/null || true; done
    wait 2> /dev/null || true
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Each replica reads the key from the environment (out of the process list).
for i in 0 1; do
    port=${replica_ports[$i]}
    "${specengine[@]}" serve --host 127.0.0.1 --port "$port" "$@" > "$run_dir/replica-$port.log" 2>&1 &
    echo $! > "$run_dir/replica-$port.pid"
    pids=("$!" "${pids[@]}")
done

# Ready: /health answers 200 once the models are loaded and warmed up (before that the port
# refuses connections).
deadline=$((SECONDS + ready_timeout))
for port in "${replica_ports[@]}"; do
    until curl -fs -o /dev/null "http://127.0.0.1:$port/health"; do
        if ! kill -0 "$(cat "$run_dir/replica-$port.pid")" 2> /dev/null; then
            echo "serve-replicas.sh: the replica on port $port stopped; its log:" >&2
            tail -n 20 "$run_dir/replica-$port.log" >&2
            exit 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "serve-replicas.sh: the replica on port $port was not ready within ${ready_timeout} s" >&2
            exit 1
        fi
        sleep 0.5
    done
done

sed -e "s/127\.0\.0\.1:8000;/127.0.0.1:$router_port;/" \
    -e "s/127\.0\.0\.1:8001 /127.0.0.1:${replica_ports[0]} /" \
    -e "s/127\.0\.0\.1:8002 /127.0.0.1:${replica_ports[1]} /" "$here/nginx.conf" > "$run_dir/nginx.conf"
nginx -p "$run_dir" -e stderr -c "$run_dir/nginx.conf" -g 'daemon off;' 2> "$run_dir/nginx.log" &
pids=("$!" "${pids[@]}")
until curl -s -o /dev/null "http://127.0.0.1:$router_port/health"; do
    if ! kill -0 "${pids[0]}" 2> /dev/null; then
        echo "serve-replicas.sh: nginx did not start; its log:" >&2
        cat "$run_dir/nginx.log" >&2
        exit 1
    fi
    sleep 0.2
done
echo "ready: http://127.0.0.1:$router_port/v1 -> replicas on ports ${replica_ports[*]}; logs in $run_dir" >&2

nginx_pid=${pids[0]}
declare -A reported
while kill -0 "$nginx_pid" 2> /dev/null; do
    alive=0
    for port in "${replica_ports[@]}"; do
        if kill -0 "$(cat "$run_dir/replica-$port.pid")" 2> /dev/null; then
            alive=$((alive + 1))
        elif [ -z "${reported[$port]:-}" ]; then
            reported[$port]=1
            echo "serve-replicas.sh: warning: the replica on port $port stopped (log:" \
                 "$run_dir/replica-$port.log); nginx sends its requests to the other" >&2
        fi
    done
    if [ "$alive" -eq 0 ]; then
        echo "serve-replicas.sh: both replicas stopped; logs in $run_dir" >&2
        exit 1
    fi
    sleep 1
done
echo "serve-replicas.sh: nginx stopped; its log: $run_dir/nginx.log" >&2
exit 1
