#!/usr/bin/env bash
# Re-run the CPU training tables of docs/benchmarks.md (on a quiet machine: nothing else using the cores), then
# regenerate the page from docs/bench/*.json. The other tables' commands are in their captions.
# Each `lightning-perf bench` runs every configuration in a fresh process, repeats interleaved.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench
steps=${STEPS:-15}
repeats=${REPEATS:-3}
lightning-perf bench --force --workload convnet --quiet --steps "$steps" --repeats "$repeats" --output "$out/convnet-cpu.json" \
  --configs baseline,bf16-mixed,channels_last,compile,backend_flags,fused_optimizer,channels_last+compile+fused_optimizer
lightning-perf bench --force --workload unet3d --quiet --steps "$steps" --repeats "$repeats" --output "$out/unet3d-cpu.json" \
  --configs baseline,channels_last,compile,channels_last+compile
lightning-perf bench --force --workload vit --quiet --steps "$steps" --repeats "$repeats" --output "$out/vit-cpu.json" \
  --configs baseline,channels_last,compile,backend_flags,grad_checkpoint,flash_attention
lightning-perf bench --force --workload lm --quiet --steps "$steps" --repeats "$repeats" --output "$out/lm-cpu.json" \
  --configs baseline,grad_checkpoint,flash_attention,compile

# The auto-tuner on each workload (budget 5 minutes), then the bench on its recommendation against the best single
# configuration of the tables above (convnet: compile, unet3d: channels_last, vit: compile, lm: compile).
for w in convnet vit lm unet3d; do
  lightning-perf autotune --force --workload "$w" --time-budget 300 --output "$out/autotune-$w.yaml"
done
declare -A best=([convnet]=compile [unet3d]=channels_last [vit]=compile [lm]=compile)
for w in convnet unet3d vit lm; do
  stack=$(python -c "import json; print('+'.join(json.load(open('$out/autotune-$w.json'))['recommendation']['configs']))")
  if [ -z "$stack" ] || [ "$stack" = "${best[$w]}" ]; then
    echo "autotune $w recommends '${stack:-nothing}': no tuned bench"; rm -f "$out/tuned-$w-cpu".{json,md,png}; continue
  fi
  lightning-perf bench --force --workload "$w" --quiet --steps "$steps" --repeats "$repeats" --predict-batches 0 \
    --configs "baseline,${best[$w]},$stack" --output "$out/tuned-$w-cpu.json"
done

# QAT: accuracy of the int8 model, its latency against fp32 (both compiled), the fake-quant training overhead.
python examples/qat_convnet.py --preset default
lightning-perf bench --force --workload convnet --quiet --steps "$steps" --repeats "$repeats" --output "$out/qat-convnet-cpu.json" \
  --configs baseline,qat

# Observers' cost against Lightning's profilers.
python examples/observer_overhead.py --rounds 3 --steps 2560 --long-steps 256 --output "$out/observer-overhead.json"

# The page: every table from the result files (docs/benchmarks.template.md holds the prose).
python docs/make_benchmarks_md.py
