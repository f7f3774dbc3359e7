#!/usr/bin/env bash
# Reproduce the shipped model's older tables in docs/results.md (multikey, passkey and perplexity at n=10 and n=3
# under "Methods compared: the shipped model" and "Perplexity", the bench tables on it and on a larger random model
# under "Decode"). Writes docs/results/shipped-*, random-bench-2k (JSON, CSV, PNG) and prints the Markdown tables to
# paste into docs/results.md. Run with nothing else busy on the machine.
#   bash bench/readme_results.sh
set -euo pipefail
cd "$(dirname "$0")/.."
blas=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
[ -e "$blas" ] && export LD_PRELOAD=$blas   # ~30x faster mlx CPU matmuls (apt-get install libopenblas0-pthread)
out=docs/results
veloxpatch eval --contexts 1024 --samples 10 --methods snapkv,streamingllm,rotating --out $out/shipped-tasks-1k
# mlx's CPU quantized matmul is slow, so mlx_lm's QuantizedKVCache gets fewer samples
veloxpatch eval --contexts 1024 --samples 3 --methods quantized --out $out/shipped-tasks-1k-quantized --no-plots
# the full-cache passkey bar on seeds 1000-1099 (never used in training or to pick the checkpoint)
veloxpatch eval --tasks passkey --budgets 100% --contexts 1024 --samples 100 --seed 1000 --out $out/shipped-passkey-1k-heldout --no-plots
veloxpatch bench --contexts 1024,2048 --budget 256 --repeats 3 --new-tokens 64 --out $out/shipped-bench-2k
veloxpatch bench --contexts 2048 --budget 256 --repeats 3 --new-tokens 64 --compress chunk --methods snapkv,streamingllm \
    --out $out/shipped-bench-2k-chunk
veloxpatch bench --random-model --contexts 2048 --budget 256 --repeats 2 --new-tokens 32 --out $out/random-bench-2k
python bench/results_md.py $out/shipped-tasks-1k/eval.json $out/shipped-tasks-1k-quantized/eval.json \
    --bench $out/shipped-bench-2k/bench.json $out/shipped-bench-2k-chunk/bench.json $out/random-bench-2k/bench.json
