#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (torch only, no Ray, maybe no pytest):
# the gpu-marked engine tests, then gpu_check.py. Figures land in $OUT (default /tmp).
#   bash benchmarks/gpu_session.sh            # ~8 min on an H200
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>/dev/null || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
status=0
if python -c "import pytest" 2>/dev/null; then
    # -o addopts= : no doctests of the Ray front end, whatever plugins are missing
    timeout 240 python -m pytest -q -m gpu tests/engine tests/frontends/test_shard.py tests/frontends/test_shard_amp.py -p no:cacheprovider -o addopts= \
        2>&1 | tail -40 | tee "$OUT/gpu_tests.txt" || status=1
else
    echo "pytest not installed: skipping the gpu-marked tests"
fi
timeout 420 python benchmarks/gpu_check.py --out "$OUT/gpu_check.json" 2>&1 \
    | tee "$OUT/gpu_check.txt" || status=1
exit $status
