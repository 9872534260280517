#!/usr/bin/env bash
# `ray up` for real, on this machine: the on-prem config (provider "local") launched over SSH
# to this machine's own loopback, then the benchmark job, a Serve deployment, `ray down`.
#
#   RAYLM_RAY_UP_SMOKE=1 ./cluster/smoke_ray_up.sh        # as root, on a throwaway Debian box
#
# It installs what it needs (openssh-server, rsync, netcat-openbsd; purged again at the end
# unless they were there before), starts a private sshd on 127.0.0.1:$RAYLM_SMOKE_SSH_PORT
# (default 2222; its own config, host key and pid file, nothing of the system's sshd), makes
# a key pair and a user for the run, derives the config from cluster/configs/local-onprem.yaml
# (head_ip 127.0.0.1, no workers, this checkout's .venv, private ports and temp dir) and
# checks each step. An EXIT trap takes everything down again, also when a step fails.
#
# The run's user is an alias of uid 0 with its own home in the run's folder: the .venv's
# interpreter lives under /root (mode 700), which an ordinary user cannot execute, and
# `ray up` writes into the SSH user's home (~/.ray/auth_token, ~/ray_bootstrap_*.yaml, the
# ~/raylm mount), which must not be root's own. sshd allows that user only, by key only.
#
# `ray down` runs a plain `ray stop` on the head, which would stop every Ray on the machine:
# the user's ~/.bashrc makes `ray stop` stop only the processes of this run (they carry
# RAYLM_SMOKE_ID in their environment). Knobs: RAYLM_SMOKE_BREAK_SETUP=1 appends `false` to
# setup_commands (the test of a failing step); RAYLM_SMOKE_KEEP_PACKAGES=1 keeps the packages;
# RAYLM_SMOKE_LOG_DIR=DIR keeps the steps' logs there.
set -uo pipefail

if [ "${RAYLM_RAY_UP_SMOKE:-}" != 1 ]; then
    echo "smoke_ray_up.sh: refusing to run: it installs packages, adds a user and runs sshd;" \
         "set RAYLM_RAY_UP_SMOKE=1 on a machine where that is allowed" >&2
    exit 2
fi
if [ "$(id -u)" != 0 ]; then
    echo "smoke_ray_up.sh: must run as root (apt-get, useradd, sshd)" >&2
    exit 2
fi

REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=$REPO/.venv
SMOKE_USER=${RAYLM_SMOKE_USER:-raylm-smoke}
SSH_PORT=${RAYLM_SMOKE_SSH_PORT:-2222}
RUN_ID=rlsmk$$
CLUSTER=raylm-smoke-$$
PACKAGES=(openssh-server rsync netcat-openbsd)

WORK=$(mktemp -d /tmp/rlsmk.XXXXXX)   # short: Ray's unix sockets live under it
chmod 755 "$WORK"
LHOME=$WORK/lhome          # HOME of the launching side (ray up, job and serve clients)
RHOME=$WORK/rhome          # home of the SSH user: the "head node"
CONFIG=$WORK/onprem-smoke.yaml
LOGS=$WORK/logs
mkdir -p "$LHOME" "$RHOME" "$LOGS"

RAY_UP_RAN=0
USER_MADE=0
SSHD_PID=
RUN_SSHD_MADE=0
NEW_PACKAGES=()
SSHD_USER_NEW=0
FAILED_STEP=
TMP_BEFORE=$WORK/tmp_before
ls -A /tmp /tmp/ray 2>/dev/null | sort -u > "$TMP_BEFORE"

# Local Ray clients: a home of their own (the token), never someone else's cluster.
lray() { env -u RAY_ADDRESS HOME="$LHOME" RAY_AUTH_MODE=token "$VENV/bin/$1" "${@:2}"; }

free_port() { "$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# The processes of this run: those with RAYLM_SMOKE_ID=$RUN_ID in their environment (every
# process `ray start` starts inherits it), working in $WORK or naming the run's Ray
# directory in their arguments, and all their descendants. The environment alone misses some: Ray's agents (ray::DashboardAgent,
# ray::RuntimeEnvAgent) rewrite theirs with their process title, and an agent whose main
# thread has exited (a zombie whose other threads still run) shows none at all; so each
# thread's own environment and working directory are read, and the process tree is
# snapshotted before anything is killed (an orphan's parent becomes init). See
# cluster/smoke_run_processes.py.
cat > "$WORK/scoped_stop.sh" <<EOF
#!/usr/bin/env bash
# Stops this smoke run's processes only (see run_processes.py), not others'.
exec "$VENV/bin/python" "$REPO/cluster/smoke_run_processes.py" "$WORK" "$RUN_ID" ray-stop
EOF
chmod 755 "$WORK/scoped_stop.sh"

cleanup() {
    local rc=$? t0
    t0=$(date +%s.%N)
    trap - EXIT INT TERM
    if [ "$RAY_UP_RAN" = 1 ]; then
        if ! timeout 180 env -u RAY_ADDRESS HOME="$LHOME" RAY_AUTH_MODE=token "$VENV/bin/ray" down -y "$CONFIG" > "$LOGS/down.log" 2>&1; then
            echo "cleanup: ray down failed:" >&2; tail -n 20 "$LOGS/down.log" >&2
            [ "$rc" = 0 ] && rc=1
        fi
    fi
    # Nothing the run started may outlive it: Ray's daemons, agents and workers (whatever
    # ray down left), the sshd with its sessions, the launching side's clients. Then check.
    "$VENV/bin/python" "$REPO/cluster/smoke_run_processes.py" "$WORK" "$RUN_ID" cleanup $SSHD_PID > "$LOGS/stopped.txt"
    local ray_left
    ray_left=$(grep -v "(sshd\|(ssh," "$LOGS/stopped.txt" | sed -n 's/^stopped: pid [0-9]* (\([^,]*\),.*/\1/p' | sort | uniq -c | xargs)
    [ -n "$ray_left" ] && echo "cleanup: stopped what ray down left running: $ray_left"
    if ! "$VENV/bin/python" "$REPO/cluster/smoke_run_processes.py" "$WORK" "$RUN_ID" check $SSHD_PID > "$LOGS/left.txt"; then
        echo "cleanup: processes of the run are still running:" >&2; sed 's/^/    /' "$LOGS/left.txt" >&2
        rc=1; FAILED_STEP=${FAILED_STEP:-cleanup (processes left running)}
    fi
    if [ "$USER_MADE" = 1 ]; then
        userdel -f "$SMOKE_USER" 2>/dev/null || { echo "cleanup: userdel $SMOKE_USER failed" >&2; rc=1; }
    fi
    [ "$RUN_SSHD_MADE" = 1 ] && rmdir /run/sshd 2>/dev/null
    if [ ${#NEW_PACKAGES[@]} -gt 0 ] && [ "${RAYLM_SMOKE_KEEP_PACKAGES:-}" != 1 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq "${NEW_PACKAGES[@]}" > "$LOGS/purge.log" 2>&1 \
            || { echo "cleanup: apt-get purge failed" >&2; tail -n 5 "$LOGS/purge.log" >&2; }
        [ "$SSHD_USER_NEW" = 1 ] && userdel sshd 2>/dev/null
    fi
    # What ray up left on the launching side: the local provider's state file and lock,
    # the SSH control sockets, cached configs. Only names that were not there before.
    rm -f "/tmp/ray/cluster-$CLUSTER.state" "/tmp/ray/cluster-$CLUSTER.lock"
    local name
    ls -A /tmp /tmp/ray 2>/dev/null | sort -u | comm -13 "$TMP_BEFORE" - | while read -r name; do
        case "$name" in
            ray_ssh_*|ray-config-*|ray-bootstrap-*|"torchinductor_$SMOKE_USER") rm -rf "/tmp/$name" ;;
        esac
    done
    [ -n "${RAYLM_SMOKE_LOG_DIR:-}" ] && mkdir -p "$RAYLM_SMOKE_LOG_DIR" && cp -r "$LOGS/." "$RAYLM_SMOKE_LOG_DIR/"
    rm -rf "$WORK"
    echo "cleanup (ray down, sshd, user, key, packages, files): done ($("$VENV/bin/python" -c "import time;print(f'{time.time()-$t0:.1f}')") s)${FAILED_STEP:+; the run FAILED at $FAILED_STEP}"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# step N NAME FUNCTION: runs it with its output in $LOGS/stepN.log; one summary line.
step() {
    local n=$1 name=$2 fn=$3 t0 t1 rc
    t0=$(date +%s.%N)
    ( "$fn" ) > "$LOGS/step$n.log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    local dt
    dt=$("$VENV/bin/python" -c "print(f'{$t1-$t0:.1f}')")
    if [ "$rc" = 0 ]; then
        echo "step $n $name: ok ($dt s)"
    else
        echo "step $n $name: FAILED ($dt s), last lines of its log:"
        tail -n 40 "$LOGS/step$n.log" | sed 's/^/    /'
        FAILED_STEP="step $n $name"
        exit 1
    fi
}

# --- step 1: sshd on 127.0.0.1 only, a key and a user for the run ----------------------
step1() {
    set -e
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        dpkg-query -W -f='${Package}\n' | sort > "$WORK/pkgs_before"
        # openssh-server's postinst adds a system user "sshd" that its purge leaves behind
        id sshd >/dev/null 2>&1 || echo SSHD_USER_NEW=1 > "$WORK/sshd_user_new.sh"
        # policy-rc.d (Docker's, or ours for the install) keeps Debian's sshd from starting on :22.
        local policy_made=0
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; policy_made=1
        fi
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
        [ "$policy_made" = 1 ] && rm -f /usr/sbin/policy-rc.d
        dpkg-query -W -f='${Package}\n' | sort | comm -13 "$WORK/pkgs_before" - > "$WORK/pkgs_new"
        echo "NEW_PACKAGES=($(tr '\n' ' ' < "$WORK/pkgs_new"))" > "$WORK/new_packages.sh"
    fi
    if ss -ltn "( sport = :$SSH_PORT )" | grep -q LISTEN; then
        echo "port $SSH_PORT is taken: set RAYLM_SMOKE_SSH_PORT"; return 1
    fi
    if id "$SMOKE_USER" >/dev/null 2>&1; then echo "user $SMOKE_USER exists already"; return 1; fi
    ssh-keygen -q -t ed25519 -N '' -C "raylm-smoke-$RUN_ID" -f "$WORK/id_ed25519"
    ssh-keygen -q -t ed25519 -N '' -f "$WORK/ssh_host_ed25519_key"
    cp "$WORK/id_ed25519.pub" "$WORK/authorized_keys"; chmod 600 "$WORK/authorized_keys"
    useradd -o -u 0 -g 0 -M -p "*" -d "$RHOME" -s /bin/bash "$SMOKE_USER"
    echo USER_MADE=1 > "$WORK/user_made.sh"
    # The head's login environment: token auth, and a `ray stop`
    # that stops this run's processes only (ray down runs a plain `ray stop` on the head).
    cat > "$RHOME/.bashrc" <<EOF
export RAY_AUTH_MODE=token
ray() { if [ "\${1:-}" = stop ]; then $WORK/scoped_stop.sh; else command ray "\$@"; fi; }
EOF
    cat > "$WORK/sshd_config" <<EOF
ListenAddress 127.0.0.1
Port $SSH_PORT
HostKey $WORK/ssh_host_ed25519_key
PidFile $WORK/sshd.pid
AuthorizedKeysFile $WORK/authorized_keys
AllowUsers $SMOKE_USER
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AllowTcpForwarding yes
X11Forwarding no
MaxStartups 50
MaxSessions 50
EOF
    if [ ! -d /run/sshd ]; then mkdir -p /run/sshd; chmod 755 /run/sshd; echo RUN_SSHD_MADE=1 > "$WORK/run_sshd_made.sh"; fi
    /usr/sbin/sshd -t -f "$WORK/sshd_config"
    /usr/sbin/sshd -f "$WORK/sshd_config"
    for _ in $(seq 50); do [ -s "$WORK/sshd.pid" ] && break; sleep 0.1; done
    ssh -i "$WORK/id_ed25519" -p "$SSH_PORT" -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
        -o BatchMode=yes "$SMOKE_USER@127.0.0.1" 'echo ssh-ok; type ray' | grep -q ssh-ok
    # sshd listens on 127.0.0.1 only
    ss -ltn "( sport = :$SSH_PORT )" | awk 'NR>1 {print $4}' | tee "$WORK/sshd_listen"
    ! grep -qv "^127.0.0.1:$SSH_PORT$" "$WORK/sshd_listen"
}

# --- step 2: the derived config, ray up ----------------------------------------------
step2() {
    set -e
    GCS_PORT=$(free_port); DASH_PORT=$(free_port); CLIENT_PORT=$(free_port); AGENT_PORT=$(free_port)
    AGENT_GRPC_PORT=$(free_port); METRICS_PORT=$(free_port); RTENV_PORT=$(free_port)
    OM_PORT=$(free_port); NM_PORT=$(free_port); SERVE_PORT=$(free_port)
    declare -p GCS_PORT DASH_PORT SERVE_PORT AGENT_PORT > "$WORK/ports.sh"
    mkdir -p "$LHOME/.ray"
    HOME="$LHOME" RAY_AUTH_MODE=token "$VENV/bin/ray" get-auth-token --generate > /dev/null
    test -s "$LHOME/.ray/auth_token"
    SMOKE_ID=$RUN_ID SMOKE_CLUSTER=$CLUSTER SMOKE_USER=$SMOKE_USER SMOKE_KEY=$WORK/id_ed25519 \
    SMOKE_SSH_PORT=$SSH_PORT SMOKE_VENV=$VENV SMOKE_TMP=$WORK/ray GCS_PORT=$GCS_PORT DASH_PORT=$DASH_PORT \
    CLIENT_PORT=$CLIENT_PORT AGENT_PORT=$AGENT_PORT AGENT_GRPC_PORT=$AGENT_GRPC_PORT METRICS_PORT=$METRICS_PORT \
    RTENV_PORT=$RTENV_PORT OM_PORT=$OM_PORT NM_PORT=$NM_PORT BREAK_SETUP=${RAYLM_SMOKE_BREAK_SETUP:-} \
    "$VENV/bin/python" - "$REPO/cluster/configs/local-onprem.yaml" "$CONFIG" <<'EOF'
import os, sys, yaml
e = os.environ
config = yaml.safe_load(open(sys.argv[1]))
venv = e["SMOKE_VENV"]
config["cluster_name"] = e["SMOKE_CLUSTER"]
config["provider"] = {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
# Ray's auth section has no SSH port: reach the run's sshd through a ProxyCommand.
config["auth"] = {"ssh_user": e["SMOKE_USER"], "ssh_private_key": e["SMOKE_KEY"],
                  "ssh_proxy_command": f"nc %h {e['SMOKE_SSH_PORT']}"}
# No downloads: this checkout's .venv (raylm installed editable) instead of a fresh venv.
# The config's own commands that download nothing (putting the venv on PATH) stay.
kept = [c.replace("$HOME/raylm-venv", venv).replace("~/raylm-venv", venv) for c in config["setup_commands"]
        if "pip install" not in c and "-m venv" not in c]
assert kept, "local-onprem.yaml no longer puts its venv on PATH"
setup = [f"{venv}/bin/python -c 'import raylm.deploy.serve_app, ray; assert ray.__version__ == \"2.60.0\", ray.__version__'",
         *kept, "test -f ~/raylm/cluster/benchmarks/bench_job.py && test -s ~/.ray/auth_token"]
if e.get("BREAK_SETUP"):
    setup.append("false")
config["setup_commands"] = setup
ports = (f"--port={e['GCS_PORT']} --dashboard-host=127.0.0.1 --dashboard-port={e['DASH_PORT']}"
         f" --ray-client-server-port={e['CLIENT_PORT']} --dashboard-agent-listen-port={e['AGENT_PORT']}"
         f" --dashboard-agent-grpc-port={e['AGENT_GRPC_PORT']} --metrics-export-port={e['METRICS_PORT']}"
         f" --runtime-env-agent-port={e['RTENV_PORT']} --object-manager-port={e['OM_PORT']}"
         f" --node-manager-port={e['NM_PORT']} --min-worker-port=21000 --max-worker-port=21999")
config["head_start_ray_commands"] = [
    "ray stop",  # the run's scoped `ray stop` (see the user's ~/.bashrc)
    f"ulimit -n 65536; RAYLM_SMOKE_ID={e['SMOKE_ID']} RAY_AUTH_MODE=token {venv}/bin/ray start --head"
    f" {ports} --num-cpus=4 --temp-dir={e['SMOKE_TMP']} --autoscaling-config=~/ray_bootstrap_config.yaml"]
config["worker_start_ray_commands"] = []
yaml.safe_dump(config, open(sys.argv[2], "w"), sort_keys=False)
EOF
    cat "$CONFIG"
    echo RAY_UP_RAN=1 > "$WORK/ray_up_ran.sh"
    timeout 600 env -u RAY_ADDRESS HOME="$LHOME" "$VENV/bin/ray" up -y --no-config-cache "$CONFIG"
}

# --- step 3: the head: ray status over ray exec; dashboard on 127.0.0.1 only ----------
step3() {
    set -e
    . "$WORK/ports.sh"
    lray ray exec "$CONFIG" "ray status --address=127.0.0.1:$GCS_PORT" | tee "$WORK/status.txt"
    grep -q "Active:" "$WORK/status.txt"
    local code
    code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$DASH_PORT/api/version")
    echo "dashboard 127.0.0.1:$DASH_PORT /api/version -> $code"; [ "$code" != 000 ]
    lray ray job list --address "http://127.0.0.1:$DASH_PORT" > /dev/null
    echo "job API on 127.0.0.1:$DASH_PORT answers"
    local addr
    for addr in $(hostname -I); do
        [ "$addr" = 127.0.0.1 ] && continue
        case "$addr" in *:*) url="http://[$addr]:$DASH_PORT/api/version" ;; *) url="http://$addr:$DASH_PORT/api/version" ;; esac
        if curl -s -m 5 -o /dev/null "$url"; then echo "dashboard answers on $addr: it must not"; return 1; fi
        echo "dashboard does not answer on $addr (ok)"
    done
    # Everything else the run's Ray listens on (the node's ports face the other nodes), and
    # the dashboard agent's job endpoint there: it must want the token.
    local pids
    pids=$(for d in /proc/[0-9]*; do tr '\0' '\n' 2>/dev/null < "$d/environ" | grep -qx "RAYLM_SMOKE_ID=$RUN_ID" && echo "pid=${d#/proc/},"; done; true)
    echo "listening sockets of the run's Ray processes, not on loopback:"
    ss -ltnpH | grep -F "$pids" | awk '$4 !~ /^127\.0\.0\.1:/ {print "   ", $4, $6}' | sort -u || true
    for addr in $(hostname -I); do
        case "$addr" in *:*) url="http://[$addr]:$AGENT_PORT" ;; *) url="http://$addr:$AGENT_PORT" ;; esac
        code=$(curl -s -m 5 -o /dev/null -w '%{http_code}' "$url/api/job_agent/jobs/" || true)
        echo "dashboard agent job endpoint on $addr:$AGENT_PORT without the token -> $code"
        case "$code" in 2*) echo "the agent's job API answers without the token"; return 1 ;; esac
    done
    ss -ltn "( sport = :$DASH_PORT )" | awk 'NR>1 {print $4}' | tee "$WORK/dash_listen"
    ! grep -qv "^127.0.0.1:$DASH_PORT$" "$WORK/dash_listen"
}

# --- step 4: the benchmark job through the token --------------------------------------
step4() {
    set -e
    . "$WORK/ports.sh"
    local out=$WORK/bench job=raylm-smoke-bench-$RUN_ID
    timeout 600 env -u RAY_ADDRESS HOME="$LHOME" RAY_AUTH_MODE=token "$VENV/bin/ray" job submit \
        --address "http://127.0.0.1:$DASH_PORT" --submission-id "$job" \
        --runtime-env-json '{"env_vars": {"OMP_NUM_THREADS": "1"}}' -- \
        "$VENV/bin/python" -m raylm.cluster.benchmarks.bench_job --model "$REPO/models/assets/raylm-demo-code" \
        --tp-sizes 1 --batch-sizes 1,2 --input-len 8 --output-len 4 --out "$out" -- --num-gpu-blocks-override 64
    lray ray job status --address "http://127.0.0.1:$DASH_PORT" "$job" | tee "$WORK/job_status.txt"
    grep -qi succeeded "$WORK/job_status.txt"
    "$VENV/bin/python" - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
report = json.loads((out / "bench_result.json").read_text())
points = report["throughput"]
assert [p["batch_size"] for p in points] == [1, 2], points
assert all(p["output_tokens_per_s"] > 0 for p in points), points
png = (out / "throughput_vs_tp.png").read_bytes()
assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
print("bench_result.json:", {f"bs{p['batch_size']}": round(p["output_tokens_per_s"], 1) for p in points})
EOF
}

# --- step 5: Serve: deploy the demo model, one OpenAI completion ----------------------
step5() {
    set -e
    . "$WORK/ports.sh"
    # deploy/serve_config.yaml as shipped, on a free port (8000 may be another Ray's Serve).
    sed "s/^\(  port:\) 8000$/\1 $SERVE_PORT/" "$REPO/deploy/serve_config.yaml" > "$WORK/serve_config.yaml"
    grep -q "port: $SERVE_PORT" "$WORK/serve_config.yaml"
    lray serve deploy "$WORK/serve_config.yaml" -a "http://127.0.0.1:$DASH_PORT"
    local deadline=$((SECONDS + 300)) status=
    while [ $SECONDS -lt $deadline ]; do
        status=$(lray serve status -a "http://127.0.0.1:$DASH_PORT" 2>&1 || true)
        echo "$status" | grep -q "status: RUNNING" && echo "$status" | grep -A3 "raylm:" | grep -q "status: RUNNING" && break
        echo "$status" | grep -q "DEPLOY_FAILED" && { echo "$status"; return 1; }
        sleep 3
    done
    echo "$status"
    curl -sS -m 120 "http://127.0.0.1:$SERVE_PORT/v1/completions" -H 'Content-Type: application/json' \
        -d '{"model": "raylm-demo-code", "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0}' \
        | tee "$WORK/completion.json"; echo
    "$VENV/bin/python" -c '
import json, sys
answer = json.load(open(sys.argv[1]))
text = answer["choices"][0]["text"]
assert text.strip(), answer
print("completion:", repr(text))' "$WORK/completion.json"
    for addr in $(hostname -I); do
        case "$addr" in *:*) url="http://[$addr]:$SERVE_PORT/" ;; *) url="http://$addr:$SERVE_PORT/" ;; esac
        if curl -s -m 5 -o /dev/null "$url"; then echo "Serve answers on $addr: it must not"; return 1; fi
    done
}

step_state() {  # what a step's subshell-free function recorded for the trap
    [ -f "$WORK/new_packages.sh" ] && . "$WORK/new_packages.sh"
    [ -f "$WORK/user_made.sh" ] && . "$WORK/user_made.sh"
    [ -f "$WORK/run_sshd_made.sh" ] && . "$WORK/run_sshd_made.sh"
    [ -f "$WORK/sshd_user_new.sh" ] && . "$WORK/sshd_user_new.sh"
    [ -f "$WORK/ray_up_ran.sh" ] && . "$WORK/ray_up_ran.sh"
    [ -s "$WORK/sshd.pid" ] && SSHD_PID=$(cat "$WORK/sshd.pid")
    return 0
}

run_step() { local rc; ( step "$@" ); rc=$?; step_state; [ "$rc" = 0 ] || { FAILED_STEP="step $1 $2"; exit 1; }; }

run_step 1 sshd step1
run_step 2 ray-up step2
run_step 3 head-checks step3
run_step 4 bench-job step4
run_step 5 serve step5
T6=$(date +%s.%N)
timeout 180 env -u RAY_ADDRESS HOME="$LHOME" RAY_AUTH_MODE=token "$VENV/bin/ray" down -y "$CONFIG" > "$LOGS/step6.log" 2>&1 || { echo "step 6 ray-down: FAILED"; tail -n 30 "$LOGS/step6.log"; FAILED_STEP="step 6 ray-down"; exit 1; }
RAY_UP_RAN=0
echo "step 6 ray-down: ok ($("$VENV/bin/python" -c "import time;print(f'{time.time()-$T6:.1f}')") s; sshd, user, key and files: in the cleanup line)"
