#!/bin/bash
# Bytes on the wire per training step, counted by the kernel: two network namespaces joined by a veth
# pair (no shaping), one `taco-jax train` process in each (jax.distributed + gloo over TCP). Per-step
# bytes = (tx bytes of a run of STEPS_B steps - those of a run of STEPS_A steps) / (STEPS_B - STEPS_A),
# so compilation, initialization and the final evaluation cancel out. Needs root (ip netns).
#
#   experiments/e2e/veth_bytes.sh OUT.json TRAIN_FLAGS...
#   e.g. experiments/e2e/veth_bytes.sh /tmp/exact_bf16.json --model gpt2-tiny --mesh data=1,tensor=2 --comm none --dtype bfloat16
#
# Namespaces $NS_PREFIX-0 / -1 (default tacoA; 198.18.0.1 / 198.18.0.2, RFC 2544 benchmarking range)
# and their /etc/netns hosts files are removed at exit.
set -euo pipefail
out=$1; shift
STEPS_A=${STEPS_A:-2}; STEPS_B=${STEPS_B:-6}
PY=${PYTHON:-python}  # started with -P: a folder named taco_jax in the working folder cannot shadow the package
PFX=${NS_PREFIX:-tacoA}  # another prefix runs a second measurement beside this one
NS=("$PFX-0" "$PFX-1"); IP=(198.18.0.1 198.18.0.2); DEV=("$PFX-v0" "$PFX-v1")
cleanup() { for n in "${NS[@]}"; do ip netns del "$n" 2>/dev/null || true; rm -rf "/etc/netns/$n"; done; }
trap cleanup EXIT
cleanup
host=$(hostname)
for i in 0 1; do
  ip netns add "${NS[$i]}"
  mkdir -p "/etc/netns/${NS[$i]}"
  printf '127.0.0.1 localhost\n%s %s\n' "${IP[$i]}" "$host" > "/etc/netns/${NS[$i]}/hosts"
done
ip link add "${DEV[0]}" type veth peer name "${DEV[1]}"
for i in 0 1; do
  ip link set "${DEV[$i]}" netns "${NS[$i]}"
  ip -n "${NS[$i]}" addr add "${IP[$i]}/24" dev "${DEV[$i]}"
  ip -n "${NS[$i]}" link set "${DEV[$i]}" up
  ip -n "${NS[$i]}" link set lo up
done
tx() { ip -n "${NS[$1]}" -s -j link show "${DEV[$1]}" | $PY -c 'import json,sys; print(json.load(sys.stdin)[0]["stats64"]["tx"]["bytes"])'; }
port=$((20000 + RANDOM % 20000))
run() {  # steps -> prints "tx0 tx1"
  local steps=$1 a0 a1; shift; a0=$(tx 0); a1=$(tx 1)
  for i in 1 0; do
    ip netns exec "${NS[$i]}" env JAX_PLATFORMS=cpu $PY -P -m taco_jax.cli train "$@" --steps "$steps" \
      --eval-every 100000 --coordinator "${IP[0]}:$((port + steps))" --num-processes 2 --process-id "$i" --no-progress \
      --out "$tmpd/run$steps" > "$tmpd/log$steps.$i" 2>&1 &
  done
  wait
  echo "$(( $(tx 0) - a0 )) $(( $(tx 1) - a1 ))"
}
tmpd=$(mktemp -d)
args=("$@")
read -r a0 a1 < <(run "$STEPS_A" "${args[@]}")
read -r b0 b1 < <(run "$STEPS_B" "${args[@]}")
$PY - "$out" "$tmpd/run$STEPS_B/summary.json" "$a0" "$a1" "$b0" "$b1" "$STEPS_A" "$STEPS_B" "${args[*]}" <<'PYEOF'
import json, sys
out, summ, a0, a1, b0, b1, sa, sb, flags = sys.argv[1:]
s = json.load(open(summ))
n = int(sb) - int(sa)
per = [(int(b0) - int(a0)) / n, (int(b1) - int(a1)) / n]
hlo = sum(s["wire_bytes_per_step"].values())
r = {"flags": flags, "steps": [int(sa), int(sb)], "veth_tx_bytes_per_step": per,
     "hlo_wire_bytes_per_step": s["wire_bytes_per_step"], "hlo_over_veth": [hlo / p for p in per]}
json.dump(r, open(out, "w"), indent=1)
print(json.dumps(r))
PYEOF
rm -rf "$tmpd"
