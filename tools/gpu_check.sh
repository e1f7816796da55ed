#!/usr/bin/env bash
# make gpu-check: everything that needs a CUDA GPU, in one go, on a machine that has torch,
# nvcc, pytest, pytest-benchmark and torchvision (no network needed):
#   1. build the extension for the local GPU;
#   2. the whole test suite with CUDA, and at the same time compute-sanitizer over each op's
#      CUDA kernels (tools/sanitize_cases.py): memcheck for all, racecheck and synccheck for
#      the kernels with shared memory and warp reductions, initcheck for the forward ops;
#      The suite runs each op's Triton kernels compiled too (the tests' "triton-cuda"
#      parameter), and the sanitizers go over them as well (triton:<op>);
#   3. tools/gpu_profile.py: each headline case's kernels by device time, and whether the
#      device or the host (launches, ATen calls) bounds it; tools/triton_sweep.py: each Triton
#      kernel's configurations timed per shape class, the best recorded (triton-configs.json);
#   4. the GPU benchmarks against the peers and the rooflines, the Triton kernels beside the
#      CUDA C++ ones ("torchkit (triton)"), and their report.
# Results go to benchmarks/results/<gpu>/ (gpu.json, gpu.md, charts), logs to build/gpu-check/.
# Exits non-zero if the build, a test or a sanitizer run fails. STEPS="test bench" (say) runs
# only some of steps 2 to 4 ("test", "sanitize", "profile", "sweep", "bench"); TESTS (test files) and
# SANITIZE_OPS (op names) narrow step 2 to a re-check of some ops, PROFILE_CASES (names from
# tools/gpu_profile.py) step 3 and BENCHES (benchmark files) step 4; TEST_K and BENCH_K are
# pytest -k expressions for steps 2 and 4, TEST_LIMIT and BENCH_LIMIT their limits in seconds
# (at the limit pytest is interrupted and still reports, and writes the JSON of what ran).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PY:-python3}
LOGS=build/gpu-check
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-test sanitize profile sweep bench}
TESTS=${TESTS:-tests}
SANITIZE_OPS=${SANITIZE_OPS:-cdist bilinear_pool covariance_pool knn label_smoothing_cross_entropy region_confusion pair_losses}
TRITON_ONLY_OPS="pair_losses"  # no CUDA C++ kernels: sanitized as triton:<op> only
status=0

# The distribution's g++ links the libstdc++ that torch loads. Some images put a toolchain
# first (CXX=/opt/gcc/bin/g++ on one) that links a static libstdc++ into the extension, and
# the first exception across the two runtimes crashes (tests/test_build.py checks for it).
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi

arch=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())") || exit 1
gpu=$($PY -c "import re, torch; n = torch.cuda.get_device_name(); m = re.search(r'\b([A-Z]+\d+\w*)\b', n); print((m.group(1) if m else n).lower())")
RESULTS=${RESULTS:-benchmarks/results/$gpu}
mkdir -p "$RESULTS"

SECONDS=0
TORCHKIT_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}" MAX_JOBS=${MAX_JOBS:-16} \
  $PY setup.py --quiet build_ext --inplace > "$LOGS/build.log" 2>&1 || { tail -40 "$LOGS/build.log"; exit 1; }
echo "build for sm_$arch: $SECONDS s"
$PY -c "import torchkit; print(torchkit.build_info())"
# After the build: importing torchkit needs its extension.
TRITON_OPS=$($PY -c "from torchkit import triton as t; print(' '.join(t.TRITON_KERNELS))") || exit 1

sanitize() {  # tool op
  PYTHONPATH=$PWD timeout "${SANITIZER_LIMIT:-240}" compute-sanitizer --tool "$1" --error-exitcode 9 --print-limit 20 \
    $PY tools/sanitize_cases.py "$2" > "$LOGS/sanitizer-$1-$2.log" 2>&1
  local rc=$?
  echo "compute-sanitizer --tool $1, $2: rc $rc, $(grep -h 'SUMMARY' "$LOGS/sanitizer-$1-$2.log" | tail -1)"
  [ $rc -eq 0 ]  # not rc itself: xargs stops everything at a 255
}
export -f sanitize; export PY LOGS
SECONDS=0
if [[ $STEPS == *sanitize* ]]; then
  {
    for op in $SANITIZE_OPS; do
      [[ " $TRITON_ONLY_OPS " == *" $op "* ]] || { echo "memcheck $op"; echo "initcheck $op"; }
    done
    for op in $TRITON_OPS; do
      [[ " $SANITIZE_OPS " == *" $op "* ]] && { echo "memcheck triton:$op"; echo "initcheck triton:$op"; }
    done
    for op in $SANITIZE_OPS; do  # the kernels with shared memory and warp reductions
      case $op in bilinear_pool | knn | label_smoothing_cross_entropy) echo "racecheck $op"; echo "synccheck $op" ;; esac
    done
  } | xargs -P 12 -L 1 bash -c 'sanitize $0 $1' > "$LOGS/sanitizers.txt" 2>&1 &
  sanitizers=$!
fi
if [[ $STEPS == *test* ]]; then
  timeout -s INT "${TEST_LIMIT:-0}" $PY -m pytest $TESTS ${TEST_K:+-k "$TEST_K"} -q -p no:cacheprovider \
    -n "${TEST_WORKERS:-10}" --dist loadgroup --ignore tests/test_packaging.py > "$LOGS/tests.log" 2>&1 || status=1
  echo "tests ($SECONDS s): $(tail -1 "$LOGS/tests.log")"
  grep -E "^(FAILED|ERROR)" "$LOGS/tests.log" | head -40
fi
if [[ $STEPS == *sanitize* ]]; then
  wait $sanitizers || status=1
  echo "sanitizers ($SECONDS s):"
  cat "$LOGS/sanitizers.txt"
  grep -q "rc [^0]" "$LOGS/sanitizers.txt" && status=1
fi
if [[ $STEPS == *profile* ]]; then
  SECONDS=0
  PYTHONPATH=$PWD $PY tools/gpu_profile.py ${PROFILE_CASES:-} > "$LOGS/profile.log" 2>&1 || status=1
  echo "profile ($SECONDS s, $LOGS/profile.log):"
  tail -8 "$LOGS/profile.log"
fi
if [[ $STEPS == *sweep* ]]; then
  SECONDS=0
  PYTHONPATH=$PWD $PY tools/triton_sweep.py --out "$RESULTS/triton-configs.json" > "$LOGS/sweep.log" 2>&1 || status=1
  echo "Triton configuration sweep ($SECONDS s, $RESULTS/triton-configs.json):"
  tail -12 "$LOGS/sweep.log"
fi
[[ $STEPS == *bench* ]] || exit $status

SECONDS=0
# SIGINT at the limit: pytest still finishes the session and writes the JSON of what ran.
BENCHES=${BENCHES:-benchmarks/bench_label_smoothing_cross_entropy.py benchmarks/bench_region_confusion.py \
  benchmarks/bench_cdist.py benchmarks/bench_bilinear_pool.py benchmarks/bench_covariance_pool.py benchmarks/bench_knn.py \
  benchmarks/bench_pair_losses.py}
TORCHKIT_BENCH_SECONDS=${TORCHKIT_BENCH_SECONDS:-0.3} timeout -s INT "${BENCH_LIMIT:-1200}" $PY -m pytest -m cuda -q -p no:cacheprovider \
  $BENCHES ${BENCH_K:+-k "$BENCH_K"} --benchmark-json="$RESULTS/gpu.json" --benchmark-columns=median,rounds > "$LOGS/bench.log" 2>&1
echo "benchmarks ($SECONDS s): $(tail -1 "$LOGS/bench.log")"
grep -E "^(FAILED|ERROR)" "$LOGS/bench.log" | head -20
$PY benchmarks/report.py "$RESULTS/gpu.json" > "$LOGS/report.log" 2>&1 || { tail -20 "$LOGS/report.log"; status=1; }
echo "report: $RESULTS/gpu.md"
exit $status
