#!/usr/bin/env bash
# Run a command while another Ray cluster runs on this machine (as another user's, or a second
# test run's, would): a head node of its own, started with `ray start --head`, which also makes
# it "the latest cluster" that an unpinned ray.init() or state-API call would find. Stopped
# (its process group killed: never `ray stop`, which would stop every cluster here) on the way out.
# usage: bash .ci/beside-another-ray-cluster.sh VENV_BIN_DIR COMMAND...
set -euo pipefail
bin=$1; shift
port=$("$bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
log=$(mktemp)
setsid "$bin/ray" start --head --port "$port" --num-cpus 1 --include-dashboard=false --block >"$log" 2>&1 &
decoy=$!
stop_decoy() {
    kill -- -"$decoy" 2>/dev/null || true  # Ray shuts its processes down on SIGTERM (about 10 s)
    for _ in $(seq 60); do kill -0 "$decoy" 2>/dev/null || break; sleep 0.5; done
    kill -9 -- -"$decoy" 2>/dev/null || true
    wait "$decoy" 2>/dev/null || true
    rm -f "$log"
}
trap stop_decoy EXIT
for _ in $(seq 120); do
    grep -q "block forever" "$log" && break
    kill -0 $decoy 2>/dev/null || { cat "$log" >&2; echo "CI: the other Ray cluster did not start" >&2; exit 1; }
    sleep 0.5
done
echo "CI: another Ray cluster runs at 127.0.0.1:$port"
"$@"
