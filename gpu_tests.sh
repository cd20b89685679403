#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
eval "$(bash .fa4/b/install.sh | tail -1)"
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
git log --oneline -1 > $OUT/commit.txt 2>/dev/null || true
python3 -c "import flash_attn.cute; print('fa4 ok')" 2>&1 | tail -1
timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider tests/attention tests/calibration -rs > $OUT/gpu-tests.txt 2>&1
tail -25 $OUT/gpu-tests.txt
