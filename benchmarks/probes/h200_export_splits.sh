#!/usr/bin/env bash
# Runs on the lent H200: the exported HF-shaped decoder step
# (examples/export_decoder.py --model bench --dtype f16, 4 layers, online)
# without and with merged split-KV decodes (export_options num_splits),
# each program timed beside HF sdpa in the same process. The programs are
# compiled here first (no IREE compiler there):
#   for s in 0 4 8 16; do python examples/export_decoder.py --device cuda --model bench --dtype f16 \
#     --layers 4 --formulation online --batch 1 --prompt-len 2048 --num-splits $s \
#     --save build/h200-export/bench_f16_b1x2048_online_x$s.vmfb; done
#   (and --batch 8 --prompt-len 512 for s in 0 2)
# then carry .whl and build/h200-export. Rounds alternate the programs.
set -uo pipefail
OUTDIR=${OUT:-/tmp}
ROUNDS=${ROUNDS:-2}
c="--device cuda --model bench --dtype f16 --layers 4 --formulation online --new-tokens 32 --time"
for r in $(seq 1 "$ROUNDS"); do
  for s in 0 8 4 16; do
    python3 examples/export_decoder.py $c --batch 1 --prompt-len 2048 --num-splits $s \
      --vmfb build/h200-export/bench_f16_b1x2048_online_x$s.vmfb --json "$OUTDIR/b1x2048_x${s}_r$r.json"
  done
  for s in 0 2; do
    python3 examples/export_decoder.py $c --batch 8 --prompt-len 512 --num-splits $s \
      --vmfb build/h200-export/bench_f16_b8x512_online_x$s.vmfb --json "$OUTDIR/b8x512_x${s}_r$r.json"
  done
done
