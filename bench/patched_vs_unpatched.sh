#!/usr/bin/env bash
# Whole-process cost of the shim, as a user sees it: the same unmodified mlx_lm script run plainly and under
# `veloxpatch run`, alternating, each timed by GNU time (wall seconds, peak RSS). Prints medians and ratios.
#
#   bash bench/patched_vs_unpatched.sh [RUNS] [WORDS] [-- extra veloxpatch run options]
#   e.g. bash bench/patched_vs_unpatched.sh 5 1000 -- --kv snapkv --budget 512   (1000 words ~ 11k tokens)
#
# Needs GNU time (`apt-get install time`). Preload OpenBLAS for realistic speed (see docs/how-it-works.md).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}; words=${2:-1000}; shift $(( $# >= 2 ? 2 : $# ))
[ "${1:-}" = "--" ] && shift
options=("$@"); [ ${#options[@]} -eq 0 ] && options=(--kv snapkv --budget 512)
model=$(mktemp -d)/model
python -c "from pathlib import Path; from veloxpatch.eval.random_model import write_model_dir as w; \
w(Path('$model'), hidden_size=512, num_hidden_layers=8, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)"
app=(examples/quickstart.py --model "$model" --words "$words")
measure() { /usr/bin/time -f "%e %M" -o /dev/stdout "$@" 2>/dev/null | tail -1; }
plain=(); patched=()
for _ in $(seq "$runs"); do
  plain+=("$(measure python "${app[@]}")")
  patched+=("$(measure veloxpatch run "${options[@]}" "${app[@]}")")
done
python - "$runs" "${plain[@]}" "${patched[@]}" <<'PY'
import statistics, sys
n = int(sys.argv[1]); rows = [tuple(map(float, r.split())) for r in sys.argv[2:]]
plain, patched = rows[:n], rows[n:]
med = lambda rs, i: statistics.median(r[i] for r in rs)
print(f"{'':10} {'wall s':>8} {'peak RSS MiB':>13}")
for name, rs in (("plain", plain), ("patched", patched)):
    print(f"{name:10} {med(rs, 0):8.2f} {med(rs, 1) / 1024:13.1f}")
print(f"{'ratio':10} {med(patched, 0) / med(plain, 0):8.3f} {med(patched, 1) / med(plain, 1):13.3f}")
PY
