#!/usr/bin/env bash
# GPU checks on one CUDA device (results/gpu.md records what they printed on an H100).
#   bash sweeps/gpu_checks.sh [tests|e2e|bench|bench8b|all] [OUT_DIR]
# tests:   pytest -m gpu tests/gpu (bf16 masters, bf16 vs fp32, probe equality, step and generation memory)
# e2e:     python -m grail_exp.run with trainer=gpu (real HF generation) and trainer=fsdp at world size 1
#          on a 2-layer Qwen3 architecture with the real 151,936-token vocabulary and random weights
# bench:   python -m grail_exp.bench on that 2-layer model, bf16
# bench8b: python -m grail_exp.bench at Qwen3-8B width (hidden 4096, 8 of its 36 layers), 4,096-token completions
set -uo pipefail
what=${1:-all}
out=${2:-results/gpu}
mkdir -p "$out"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 GRAIL_EXP_CACHE=${GRAIL_EXP_CACHE:-/tmp/grail_exp_cache}
QWEN=(model=qwen3_8b recipe=demo model.random_init=true model.tokenizer_name_or_path=pkg:qwen3)  # demo: one-GPU checks, not the paper's 4-GPU recipe
SMALL="model.random_init_overrides={num_hidden_layers: 2, hidden_size: 1024, intermediate_size: 3072, num_attention_heads: 16, num_key_value_heads: 8}"
WIDE="model.random_init_overrides={num_hidden_layers: 8}"
RUN=(trainer.max_steps=2 trainer.prompts_per_step=4 rollout.num_generations=4 trainer.micro_batch_size=8
     rollout.max_completion_length=128 data=arithmetic benchmark=arithmetic benchmark.limit=8 eval.n=2
     logger=none trainer.checkpoint_every=0 trainer.save_final_checkpoint=true)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

if [[ $what == tests || $what == all ]]; then
  $PY -m pytest -q -s -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$out/tests.log"
fi
if [[ $what == e2e || $what == all ]]; then
  /usr/bin/time -v $PY -m grail_exp.run "${QWEN[@]}" "$SMALL" trainer=gpu advantage=grail "${RUN[@]}" \
      paths.root_dir=/tmp/e2e_gpu hydra.run.dir=/tmp/e2e_gpu/run 2>&1 | tee "$out/e2e_gpu.log" | grep -v "it/s\]" | tail -25
  PYTHONPATH="$PWD/tests:${PYTHONPATH:-}" $PY -m grail_exp.run "${QWEN[@]}" "$SMALL" trainer=fsdp trainer.devices=1 \
      advantage=grail advantage.symmetry=both rollout.engine=fakes:ScriptedEngine "${RUN[@]}" \
      paths.root_dir=/tmp/e2e_fsdp hydra.run.dir=/tmp/e2e_fsdp/run 2>&1 | tee "$out/e2e_fsdp.log" | grep -v "it/s\]" | tail -25
  ls -la /tmp/e2e_gpu/run/checkpoints/* /tmp/e2e_fsdp/run/checkpoints/* 2>&1 | tail -12
fi
if [[ $what == bench || $what == all ]]; then
  $PY -m grail_exp.bench "${QWEN[@]}" "$SMALL" model.gradient_checkpointing=false bench.completion_length=1024 \
      bench.prompt_length=128 bench.prompts=2 bench.num_generations=8 bench.micro_batch_size=8 bench.repeats=3 \
      json="$out/bench_qwen3_2l.json" markdown="$out/bench_qwen3_2l.md" 2>&1 | grep -v "it/s\]" | tail -12
fi
if [[ $what == bench8b ]]; then
  $PY -m grail_exp.bench "${QWEN[@]}" "$WIDE" bench.completion_length=4096 bench.prompt_length=256 \
      bench.prompts=2 bench.num_generations=8 bench.micro_batch_size=8 bench.warmup=1 bench.repeats=2 \
      json="$out/bench_qwen3_8b_width.json" markdown="$out/bench_qwen3_8b_width.md" 2>&1 | grep -v "it/s\]" | tail -12
fi
