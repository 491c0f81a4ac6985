#!/usr/bin/env bash
# Ray across nodes, on one machine: the same sweep on a two-node Ray cluster (1 CPU per node), on a
# one-node cluster (1 CPU), and on the local executor; wall clock of each, the two-node/one-node ratio,
# and a check that the results of the two-node cluster and the local executor are identical.
#
#   benchmarks/ray_two_nodes.sh                       # reproduce paper --quick (docs/CLUSTER.md)
#   EXP=removability ARGS="--quick" benchmarks/ray_two_nodes.sh     # a small try of the mechanics
#
# Environment (all optional):
#   EXP      the experiment, or paper (default paper)
#   ARGS     more arguments for `softprior reproduce` (default --quick)
#   WORKERS  --workers of every sweep (default 2)
#   WORK     where the stores (S1, S2, S3), outputs and logs go (default: a new /tmp/raybench.XXXXXX)
#   PORT     the head node's GCS port (default 6390); the second node's ports are chosen by Ray
#            (two nodes on one host need no other settings: each raylet takes free ports of its own)
#   PYTHON   the interpreter with softprior and Ray installed (default: python on PATH)
#
# The nodes are started with `ray start --block` in the background and stopped by signalling those
# processes alone (not `ray stop`, which would stop every Ray of this user on the machine), with a
# token of their own for Ray's token authentication (WORK/auth_token). The
# nodes' workers inherit this shell's environment (PYTHONPATH included), so they import the same
# softprior as the driver. Runs are refused from a checkout with uncommitted changes unless ARGS has
# --exploratory (cli.common._refuse_dirty_training).
set -euo pipefail

EXP=${EXP:-paper}
ARGS=${ARGS:---quick}
WORKERS=${WORKERS:-2}
PORT=${PORT:-6390}
PYTHON=${PYTHON:-python}
WORK=${WORK:-$(mktemp -d /tmp/raybench.XXXXXX)}
RAY=$(dirname "$(command -v "$PYTHON")")/ray
[ -x "$RAY" ] || RAY=ray
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
mkdir -p "$WORK"
# Ray's token authentication, with a token of this benchmark's own (not ~/.ray/auth_token): a node
# that joins, and the driver, must present the head's token
(umask 077 && "$PYTHON" -c 'import secrets, sys; sys.stdout.write(secrets.token_hex(32))' >"$WORK/auth_token")
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$WORK/auth_token"
ADDR=127.0.0.1:$PORT
# the nodes' own temporary directory: `ray start` writes the cluster's address there (ray_current_cluster),
# which a later plain `ray.init()` on this machine would try to join; in /tmp/ray it would outlive the
# nodes. Keep the path short: Ray's sockets live under it (at most ~107 characters in all)
RAY_TMP=$WORK/ray
NODE_PIDS=()

say() { echo "[ray_two_nodes] $*" >&2; }

stop_nodes() {  # SIGTERM to our `ray start --block` processes: each takes its node's processes down
    local pid
    for pid in "${NODE_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${NODE_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    NODE_PIDS=()
}
trap stop_nodes EXIT
trap 'exit 130' INT TERM

alive_nodes() {
    "$PYTHON" - "$ADDR" <<'EOF' 2>/dev/null || echo 0
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(sum(1 for n in ray.nodes() if n["Alive"]), int(ray.cluster_resources().get("CPU", 0)))
EOF
}

start_cluster() {  # start_cluster NODES: a head and NODES-1 more nodes, 1 CPU each, on this host
    local n=$1 i
    "$RAY" start --head --port "$PORT" --num-cpus 1 --include-dashboard false --disable-usage-stats \
        --temp-dir "$RAY_TMP" --block >"$WORK/node_head.log" 2>&1 &
    NODE_PIDS+=($!)
    for ((i = 1; i < n; i++)); do
        sleep 3
        "$RAY" start --address "$ADDR" --num-cpus 1 --temp-dir "$RAY_TMP" --block >"$WORK/node_$i.log" 2>&1 &
        NODE_PIDS+=($!)
    done
    local t got
    for t in $(seq 1 60); do
        got=$(alive_nodes)
        if [ "$got" = "$n $n" ]; then
            say "cluster at $ADDR: $n alive nodes, $n CPUs"
            return 0
        fi
        sleep 2
    done
    say "the cluster did not come up with $n nodes (last: '$got'); logs in $WORK/node_*.log"
    exit 1
}

sweep() {  # sweep NAME -- softprior reproduce arguments...; prints the wall seconds
    local name=$1; shift
    local t0 t1
    t0=$(date +%s.%N)
    # shellcheck disable=SC2086
    if ! "$PYTHON" -m softprior.cli reproduce "$EXP" $ARGS --workers "$WORKERS" --no-progress \
            --store "$WORK/$name" --out "$WORK/out_$name" "$@" >"$WORK/$name.log" 2>&1; then
        say "$name failed; its log: $WORK/$name.log"
        tail -20 "$WORK/$name.log" >&2
        exit 1
    fi
    t1=$(date +%s.%N)
    echo "$t0 $t1" | awk '{printf "%.1f", $2 - $1}'
}

say "work directory $WORK; reproduce $EXP $ARGS --workers $WORKERS"

start_cluster 2
T1=$(sweep S1 --executor ray --address "$ADDR")
say "S1 (Ray, two nodes x 1 CPU): $T1 s"
stop_nodes

start_cluster 1
T2=$(sweep S2 --executor ray --address "$ADDR")
say "S2 (Ray, one node x 1 CPU): $T2 s"
stop_nodes

T3=$(sweep S3 --executor local)
say "S3 (local executor): $T3 s"

# every run of S1 and S2 against S3: same runs done, same metrics and weights, same summary numbers
# (not its time, threads or provenance); and every CSV table the reports wrote (OUT/**/*.csv)
SAME=0
"$PYTHON" - "$WORK" <<'EOF' || SAME=1
import csv
import sys
from pathlib import Path

import torch

from softprior.store import RunStore

work = Path(sys.argv[1])
SKIP = {"timing", "provenance", "calibration", "softprior_version", "git_commit", "torch_version", "cpu",
        "python_version", "threads", "seconds", "wall_seconds", "host"}


def numbers(d):
    return {k: v for k, v in d.items() if k not in SKIP and isinstance(v, (int, float, str, list))}


def _table(path):
    rows = list(csv.reader(path.open()))
    if not rows:
        return rows
    keep = [i for i, name in enumerate(rows[0]) if name != "seconds"]
    return [[r[i] for i in keep if i < len(r)] for r in rows]


def compare(a_name, b_name):
    a, b = RunStore(work / a_name), RunStore(work / b_name)
    ids = sorted(r["run_id"] for r in a.rows() if r["status"] == "done")
    problems = []
    if ids != sorted(r["run_id"] for r in b.rows() if r["status"] == "done"):
        problems.append("different runs done")
    for rid in ids:
        if a.metrics(rid) != b.metrics(rid):
            problems.append(f"{rid}: metrics differ")
        sa, sb = a.load_state(rid), b.load_state(rid)
        if set(sa) != set(sb) or not all(torch.equal(sa[k], sb[k]) for k in sa):
            problems.append(f"{rid}: weights differ")
        na, nb = numbers(a.summary(rid)), numbers(b.summary(rid))
        if na != nb:
            problems.append(f"{rid}: summary differs in {sorted(k for k in na.keys() | nb.keys() if na.get(k) != nb.get(k))}")
    tables_a = sorted(p.relative_to(work / f"out_{a_name}") for p in (work / f"out_{a_name}").rglob("*.csv"))
    tables_b = sorted(p.relative_to(work / f"out_{b_name}") for p in (work / f"out_{b_name}").rglob("*.csv"))
    if tables_a != tables_b:
        problems.append("different tables written")
    for t in tables_a:  # a table's "seconds" column (a continuation trace's time per snapshot) is a clock
        ta, tb = (_table(work / f"out_{n}" / t) for n in (a_name, b_name))
        if ta != tb:
            problems.append(f"table {t} differs")
    print(f"[ray_two_nodes] {a_name} vs {b_name}: {len(ids)} runs, {len(tables_a)} tables: "
          + ("identical" if not problems else f"{len(problems)} DIFFERENCES"), file=sys.stderr)
    for p in problems[:20]:
        print(f"    {p}", file=sys.stderr)
    return not problems


ok = compare("S1", "S3")
compare("S2", "S3")
sys.exit(0 if ok else 1)
EOF

echo "wall clock of reproduce $EXP $ARGS --workers $WORKERS (sweep and reports):"
echo "  two nodes (S1): $T1 s   one node (S2): $T2 s   local (S3): $T3 s"
awk -v a="$T1" -v b="$T2" 'BEGIN { printf "  one node / two nodes = %.2f\n", b / a }'
echo "the sweeps alone (their report lines):"
grep -H " trained, " "$WORK/S1.log" "$WORK/S2.log" "$WORK/S3.log" | sed "s|^$WORK/|  |" || true
[ "$SAME" = 0 ] && echo "results: S1 (two nodes) and S3 (local) identical" || echo "results: S1 and S3 DIFFER (above)"
exit $SAME
