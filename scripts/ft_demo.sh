#!/usr/bin/env bash
# Fault tolerance on CPU: a torchft lighthouse, three replica groups of the debug_ft config
# (tiny Llama 3, one rank each), SIGKILL of group 2 mid-run, a restart that recovers from a
# live peer, 10 more steps of all three, then SIGTERM and a summary read from the groups'
# traces. About a minute on an idle machine (most of it Python start-up).
#   scripts/ft_demo.sh                  (outputs in $OUT, default /tmp/hp_ft_demo)
set -euo pipefail
STEPS=100000  # stopped with SIGTERM once the restarted group trained 10 steps with the others
OUT=${OUT:-/tmp/hp_ft_demo}
PY=${PYTHON:-python}
rm -rf "$OUT" && mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM

$PY -m hp_trainer.cli --lighthouse --bind "[::]:0" --min_replicas 2 --join_timeout_ms 10000 \
    --heartbeat_timeout_ms 2000 >"$OUT/lighthouse.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q '^lighthouse: ' "$OUT/lighthouse.log" && break; sleep 0.2; done
PORT=$(grep '^lighthouse: ' "$OUT/lighthouse.log" | sed 's/.*://')
LH="http://127.0.0.1:$PORT"
echo "lighthouse at $LH"

group() {  # group REPLICA_ID
    OMP_NUM_THREADS=1 $PY -m hp_trainer.cli --config debug_ft --training.steps "$STEPS" \
        --fault_tolerance.replica_id "$1" --fault_tolerance.min_replica_size 2 \
        --fault_tolerance.lighthouse "$LH" --fault_tolerance.trace true \
        --metrics.log_freq 10 --job.dump_folder "$OUT" --job.run_name "g$1" \
        >>"$OUT/g$1.log" 2>&1 &
    pids+=($!)
}
steps_of() { [ -f "$OUT/g$1/ft_trace_rank0.jsonl" ] && wc -l <"$OUT/g$1/ft_trace_rank0.jsonl" || echo 0; }

group 0; group 1; group 2
victim=${pids[-1]}
until [ "$(steps_of 2)" -ge 20 ]; do
    kill -0 "$victim" 2>/dev/null || { echo "group 2 exited early: see $OUT/g2.log"; exit 1; }
    sleep 0.2
done
kill -9 "$victim"
echo "killed replica group 2 (pid $victim) after $(steps_of 2) steps at $(date +%T)"
sleep 3
date +%s.%N >"$OUT/restart_time"
group 2
echo "restarted replica group 2 at $(date +%T)"
$PY - "$OUT" <<'PY'
import json, sys, time
from pathlib import Path
trace = Path(sys.argv[1]) / "g2/ft_trace_rank0.jsonl"
deadline = time.time() + 900
while time.time() < deadline:
    rows = [json.loads(l) for l in trace.read_text().splitlines()] if trace.exists() else []
    heals = [i for i, r in enumerate(rows) if r["healed"]]
    if heals and sum(r["committed"] for r in rows[heals[-1]:]) >= 10:
        break
    time.sleep(0.5)
else:
    sys.exit("group 2 did not rejoin within 900 s")
PY
kill -TERM "${pids[1]}" "${pids[2]}" "${pids[-1]}"
wait "${pids[1]}" "${pids[2]}" "${pids[-1]}" || true

$PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
traces = {g: [json.loads(l) for l in (out / f"g{g}/ft_trace_rank0.jsonl").read_text().splitlines()]
          for g in range(3)}
restart = float((out / "restart_time").read_text())
for g in (0, 1, 2):
    if g == 2:
        break
    committed = [r["step"] for r in traces[g] if r["committed"]]
    assert committed == list(range(1, len(committed) + 1)), f"group {g} went back"
    print(f"group {g}: {len(committed)} committed steps, never went back; "
          f"{sum(not r['committed'] for r in traces[g])} discarded; participants per step "
          f"{sorted({r['participants'] for r in traces[g] if r['committed']})}")
healed = next(r for r in traces[2] if r["healed"])
ref = {r["step"]: r["params"] for r in traces[0] if r["committed"]}
after = [r for r in traces[2][traces[2].index(healed):] if r["committed"]]
same = all(ref[r["step"]] == r["params"] for r in after)
print(f"group 2 rejoined at step {healed['step']}: quorum + recovery {healed['quorum_s']:.2f} s, "
      f"{healed['time'] - restart:.1f} s after the restart command; parameters bitwise equal to "
      f"group 0 on all {len(after)} later steps: {same}")
for g in range(3):
    rows = [json.loads(l) for l in (out / f"g{g}/metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    print(f"group {g}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
PY
