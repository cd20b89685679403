#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
eval "$(bash .fa4/b/install.sh | tail -1)"
export PYTHONPATH=$PWD:$PYTHONPATH
timeout 560 python3 benchmarks/one_rank_path.py --out $OUT/one_rank.json --profile mix-64K > $OUT/one_rank.log 2>&1
tail -40 $OUT/one_rank.log
