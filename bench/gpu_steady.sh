#!/bin/bash
# The steady state on a lent GPU machine (no network there: the
# project's wheels travel in .whl/): the CPU proxy run on the GPU, a host-bound GPU step, plain and
# audited alternated, pinned to two CPUs; its log goes to $OUT.
#   bash bench/gpu_steady.sh ROUNDS STEPS [PROGRAM [MORE bench_steady_parts.py ARGS, e.g. --toggle 50]]
# (FIRST, LAST, W1, W2 in the environment move the spans: defaults 400, 800, 800:1600, 1600:STEPS)
set -u
rounds=${1:-4}; steps=${2:-2000}; program=${3:-proxy}
shift $(( $# < 3 ? $# : 3 ))
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation . >/dev/null 2>&1 || echo "project install failed"
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader
  echo "cpus $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
  python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
} 2>&1 | tee "$out/machine.txt"
python3 bench/bench_steady_parts.py --device cuda --program "$program" --rounds "$rounds" --steps "$steps" \
  --first ${FIRST:-400} --last ${LAST:-800} --window ${W1:-800:1600} --window "${W2:-1600:$steps}" --parts all --cpus 2,3 "$@" 2>&1 | tee "$out/$program.log"
