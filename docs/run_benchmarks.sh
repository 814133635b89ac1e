#!/usr/bin/env bash
# Reproduce the CPU tables of docs/benchmarks.md (run on a quiet machine: nothing else using the cores).
# Each `lightning-perf bench` runs every configuration in a fresh process, repeats interleaved.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench
steps=${STEPS:-15}
repeats=${REPEATS:-3}
lightning-perf bench --workload convnet --quiet --steps "$steps" --repeats "$repeats" --output "$out/convnet-cpu.json" \
  --configs baseline,bf16-mixed,channels_last,compile,backend_flags,fused_optimizer,channels_last+compile+fused_optimizer
lightning-perf bench --workload unet3d --quiet --steps "$steps" --repeats "$repeats" --output "$out/unet3d-cpu.json" \
  --configs baseline,channels_last,compile,channels_last+compile
lightning-perf bench --workload vit --quiet --steps "$steps" --repeats "$repeats" --output "$out/vit-cpu.json" \
  --configs baseline,channels_last,compile,backend_flags,grad_checkpoint,flash_attention
lightning-perf bench --workload lm --quiet --steps "$steps" --repeats "$repeats" --output "$out/lm-cpu.json" \
  --configs baseline,grad_checkpoint,flash_attention,compile
