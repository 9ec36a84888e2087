#!/usr/bin/env bash
# The GPU runs behind tools/PERF_LOG.md: stage a build's binaries on the build machine, carry them
# to the GPU machine, then run the GPU suite, the closing tables, A/B comparisons of staged builds
# and ncu stall profiles there, each writing its logs under $OUT.
#
# On the build machine (no GPU needed):
#   tools/prof/device.sh stage BUILD_DIR NAME
#       Copies BUILD_DIR's moejit, moejit_bench_moe, moejit_bench_runtime, moejit_gpu_tests and
#       libmoejit.so into .stage/NAME, and the shared libraries they need that a bare CUDA
#       machine may lack (libfmt, libspdlog) into .stage/lib. .stage is git-ignored: carry it
#       (".stage").
#
# On the GPU machine, from the repository root (logs go to $OUT, else .stage/out):
#   tools/prof/device.sh suite NAME [CATCH2_ARGS...]
#       Prewarms tools/shapes/reference.json for sm_90a, then runs NAME's moejit_gpu_tests
#       (several test names go in one comma-separated argument); no test run is a failure.
#       Without CATCH2_ARGS, also the cases that need a process of their own ("[.fresh]") and
#       the Python binding's GPU group (torch) on NAME's libmoejit.so.
#   tools/prof/device.sh tables NAME [SEED]
#       The decode section (with the read floor), the marlin section (with the dense baseline)
#       and moejit_bench_runtime: the closing tables of a session.
#   tools/prof/device.sh ab "NAME1 NAME2 ..." SECTION [BENCH_ARGS...]
#       moejit_bench_moe --section SECTION --gap-ms 5 for each build in turn, per seed in $SEEDS
#       (default "1 2"), so builds alternate on the same machine state, the k-th seed starting
#       at the k-th build; BENCH_ARGS go to every run (e.g. --models qwen3-30b-a3b --tokens 256
#       --no-dense).
#   tools/prof/device.sh sanitize NAME TOOL [TEST_SPEC LIMIT_S]
#       compute-sanitizer's TOOL (memcheck, initcheck, synccheck or racecheck) over the GPU tests
#       that run every kernel family and tile against the fp64 reference, each with a time limit
#       (a run cut short still reports the kernels it ran), or over TEST_SPEC alone (a Catch2
#       test spec of moejit_gpu_tests) for LIMIT_S seconds: the error summary and the distinct
#       reports by kernel and instruction offset. For synccheck and racecheck, first
#       tools/prof/sanitizer_patterns.cu under the same tool (built with the GPU machine's nvcc):
#       which correct patterns the tool reports anyway. RACECHECK_REPORT=hazard (or all) prints
#       racecheck's hazards one by one, with their threads and shared-memory addresses, in place
#       of its analysis; the first of them are shown.
#   tools/prof/device.sh probe NAME [ARGS...]
#       Builds the standalone probe tools/prof/NAME.cu with the GPU machine's nvcc for sm_90a
#       (it may include the kernels' headers) and runs it with ARGS, its output also in
#       $OUT/NAME.txt. E.g. `probe expert_stream` (PERF_LOG: "an expert-stationary fused tile").
#   tools/prof/device.sh stalls NAME KERNEL_REGEX LAUNCH_SKIP [BENCH_ARGS...]
#       ncu of one launch (the LAUNCH_SKIP-th match of KERNEL_REGEX) inside moejit_bench_moe
#       BENCH_ARGS: the warp stall metrics, then the per-instruction export read by
#       tools/prof/ncu_loops.py (each SASS loop's samples against its instructions, the
#       instructions with the most samples outside the loops and inside the hottest one).
#       E.g. the warpgroup FC1 of qwen3-30b-a3b T = 256:
#       stalls X regex:moe_gemm_wg 4 --section marlin --models qwen3-30b-a3b --tokens 256
#         --no-dense --gap-ms 5 --seed 1
#
# decode_moe's start, by timestamps: stage a build of the tree with tools/prof/decode_trace.patch
# applied (git apply; never committed), then
#   MOEJIT_TRACE=1 tools/prof/device.sh ab NAME decode --no-dense --no-floor --tokens 6,24
# prints, per persistent-tile row of the decode log, `trace` lines: each stamp's median, min,
# max over the CTAs of the last forward, in us from the reset kernel's wait end. The stamps cost
# the layer 10-25%, so they order a forward's events; they do not time its loop.
#
# Every device command uses a kernel cache of its own per build (/tmp/moejit-cache-NAME), so
# builds never share cubins. The kernels carry no line tables unless MOEJIT_LINEINFO=1 is set
# (then ncu's source page maps SASS to kernel source lines; ncu_loops.py needs only SASS).
set -euo pipefail

die() {
  echo "device.sh: $*" >&2
  exit 2
}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
stage_dir=$root/.stage
out=${OUT:-$stage_dir/out}
shapes=$root/tools/shapes/reference.json
binaries=(moejit tools/bench/moejit_bench_moe tools/bench/moejit_bench_runtime
  tests/moejit_gpu_tests)

usage() {  # [EXIT_CODE]: 0 when asked for, 2 after a usage error
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
  exit "${1:-2}"
}

build_of() {  # the staged build NAME, checked
  local dir=$stage_dir/$1
  [[ -x $dir/moejit && -x $dir/moejit_bench_moe && -x $dir/moejit_gpu_tests ]] ||
    die "no staged build '$1' in $dir (run 'tools/prof/device.sh stage BUILD_DIR $1' first)"
  echo "$dir"
}

device_env() {  # NAME: the environment the tests and benchmarks of a staged build read
  export LD_LIBRARY_PATH=$stage_dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export MOEJIT_CACHE_DIR=/tmp/moejit-cache-$1
  export MOEJIT_TEST_SHAPES_DIR=$root/tools/shapes
  export MOEJIT_TEST_SOURCE_DIR=$root
  export MOEJIT_TEST_CLI=$stage_dir/$1/moejit
}

elapsed() { echo "$(($(date +%s) - t0)) s"; }

prewarm() {  # NAME: every reference kernel into the build's cache
  local dir
  dir=$(build_of "$1")
  (device_env "$1" && "$dir/moejit" prewarm --arch sm_90a "$shapes") >"$out/prewarm-$1.txt" 2>&1 ||
    die "prewarm of build $1 failed: $out/prewarm-$1.txt"
  echo "prewarm $1: $(tail -n 1 "$out/prewarm-$1.txt")"
}

model_rows() {  # FILE: the benchmark's table rows and headers, not its progress lines
  grep -E '^ *(model|qwen3|gpt-oss|deepseek|kimi)|copy|TFLOP' "$1" | cut -c1-240 || true
}

cmd_stage() {
  [[ $# -eq 2 ]] || usage
  local build=$1 name=$2
  [[ -d $build ]] || die "no build directory $build"
  [[ $name =~ ^[A-Za-z0-9_.-]+$ && $name != lib ]] ||
    die "stage name '$name': letters, digits, '.', '_' or '-', and not 'lib'"
  mkdir -p "$stage_dir/$name" "$stage_dir/lib"
  local b
  for b in "${binaries[@]}"; do
    [[ -x $build/$b ]] ||
      die "$build/$b is missing: configure with -DMOEJIT_BUILD_TESTS=ON -DMOEJIT_BUILD_TOOLS=ON and build"
    cp "$build/$b" "$stage_dir/$name/"
  done
  # The shared library, for the Python binding's GPU group (suite).
  [[ -e $build/libmoejit.so ]] || die "$build/libmoejit.so is missing: build the moejit target"
  cp -L "$build/libmoejit.so" "$stage_dir/$name/libmoejit.so"
  # The libraries a GPU machine without the build's -dev packages would miss: cp -L follows the
  # soname link to the real file under the soname the binaries ask for.
  local lib
  while read -r lib; do
    cp -L "$lib" "$stage_dir/lib/"
  done < <(ldd "$build/moejit" "$build/tests/moejit_gpu_tests" "$build/libmoejit.so" |
    awk '$1 ~ /^lib(fmt|spdlog)\.so/ && $3 ~ /^\// {print $3}' | sort -u)
  du -sh "$stage_dir" | awk -v n="$name" '{print "staged " n "; .stage holds " $1 " (the carry limit is 64 MiB)"}'
}

# One run of NAME's moejit_gpu_tests (ARGS: Catch2's) into LOG: its summary line, labelled LABEL,
# the skips and the failures. Returns its exit status, 1 when no test ran.
gpu_tests() {
  local name=$1 label=$2 log=$3 rc=0 summary
  shift 3
  (device_env "$name" && "$stage_dir/$name/moejit_gpu_tests" "$@") >"$log" 2>&1 || rc=$?
  summary=$(grep -E '^(All tests passed|test cases:)' "$log" | tail -n 1) || true
  # Why: Catch2 exits 0 when its filter matches nothing (as Catch2 2.13 did for three names given
  # as separate arguments, which it joined into one; one comma-separated argument works).
  if [[ -z $summary ]]; then
    summary="no test ran: $(grep -m 1 -E 'No test cases matched|No tests ran' "$log" || true)"
    [[ $rc -ne 0 ]] || rc=1
  fi
  echo "gpu tests $label rc=$rc: $summary ($(elapsed))"
  grep -i -m 5 'skip' "$log" || true
  grep -B 3 -A 12 ': FAILED:' "$log" | head -n 80 || true
  return "$rc"
}

cmd_suite() {
  [[ $# -ge 1 ]] || usage
  local name=$1 dir
  shift
  dir=$(build_of "$name")
  prewarm "$name"
  local rc=0
  gpu_tests "$name" "$name" "$out/gpu-tests-$name.txt" "$@" || rc=$?
  if [[ $# -eq 0 ]]; then
    # The cases that need a process of their own ([.fresh], ctest's moejit_gpu_tests_fresh).
    gpu_tests "$name" "[.fresh] $name" "$out/gpu-tests-fresh-$name.txt" "[.fresh]" || rc=$?
    # The whole suite includes the Python binding's GPU group (torch on the GPU machine).
    local py_rc=0 py_log=$out/python-gpu-$name.txt
    (device_env "$name" && MOEJIT_LIBRARY=$dir/libmoejit.so PYTHONPATH=$root/src/python \
      python3 "$root/tests/python/test_python_binding.py" gpu) >"$py_log" 2>&1 || py_rc=$?
    echo "python gpu group $name rc=$py_rc: $(grep -E '^(OK|FAILED|skipped)' "$py_log" | tail -n 1)"
    grep -E 'rel L2|Error|FAIL' "$py_log" | head -n 40 || true
    [[ $py_rc -eq 0 ]] || rc=$py_rc
  fi
  return "$rc"
}

cmd_tables() {
  [[ $# -ge 1 && $# -le 2 ]] || usage
  local name=$1 seed=${2:-1} dir section
  dir=$(build_of "$name")
  prewarm "$name"
  for section in decode marlin; do
    (device_env "$name" &&
      "$dir/moejit_bench_moe" --section "$section" --gap-ms 5 --seed "$seed" \
        --json "$out/$section-$name.json") >"$out/$section-$name.txt" 2>&1 ||
      die "the $section section failed: $out/$section-$name.txt"
    echo "== $section section, build $name, seed $seed ($(elapsed))"
    model_rows "$out/$section-$name.txt"
  done
  (device_env "$name" && "$dir/moejit_bench_runtime" --compile-reps 2 --children 20) \
    >"$out/runtime-$name.txt" 2>&1 || die "moejit_bench_runtime failed: $out/runtime-$name.txt"
  echo "== moejit_bench_runtime, build $name ($(elapsed))"
  cat "$out/runtime-$name.txt"
}

cmd_ab() {
  [[ $# -ge 2 ]] || usage
  local names=$1 section=$2 name seed
  shift 2
  [[ $section == marlin || $section == decode ]] || die "section '$section': marlin or decode"
  for name in $names; do build_of "$name" >/dev/null; done
  # The builds' prewarms side by side; why a wait per pid: a bare `wait` returns 0 whatever
  # its jobs did, so a failed prewarm would go on to time compiles.
  local pids=() pid
  for name in $names; do
    prewarm "$name" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || die "a prewarm failed (logs: $out/prewarm-*.txt)"; done
  # Why the order turns with each seed: in one order the build that ran second was the slower on
  # every cell (tools/PERF_LOG.md, sixty-third session), so a fixed order can pass for a change.
  # The k-th seed starts at the k-th build (a rotation), so over as many seeds as builds each
  # build runs once in each place.
  local builds=($names) order turn=0 i
  for seed in ${SEEDS:-1 2}; do
    order=()
    for ((i = 0; i < ${#builds[@]}; i++)); do
      order+=("${builds[(i + turn) % ${#builds[@]}]}")
    done
    turn=$((turn + 1))
    for name in "${order[@]}"; do
      local log=$out/$section-$name-$seed.txt
      (device_env "$name" &&
        "$stage_dir/$name/moejit_bench_moe" --section "$section" --gap-ms 5 --seed "$seed" "$@") \
        >"$log" 2>&1 || die "build $name, seed $seed failed: $log"
      echo "== $section, build $name, seed $seed ($(elapsed))"
      model_rows "$log"
    done
  done
}

# Builds tools/prof/NAME.cu with the GPU machine's nvcc for sm_90a (FLAGS: more nvcc flags) into
# $out/NAME and prints that path. The probes include the kernels' own headers as the library
# embeds them: moejit/kern = kernels/.
build_prof_tool() {
  local name=$1 nvcc
  shift
  nvcc=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -n 1) || true
  [[ -n $nvcc ]] || die "nvcc not found: needed to build tools/prof/$name.cu"
  [[ -f $root/tools/prof/$name.cu ]] || die "no tools/prof/$name.cu"
  mkdir -p "$out/include/moejit"
  ln -sfn "$root/kernels" "$out/include/moejit/kern"
  "$nvcc" -std=c++17 -gencode arch=compute_90a,code=sm_90a "$@" -I "$out/include" \
    -o "$out/$name" "$root/tools/prof/$name.cu" >&2 || die "tools/prof/$name.cu did not build"
  echo "$out/$name"
}

cmd_probe() {
  [[ $# -ge 1 ]] || usage
  local name=$1 tool
  shift
  tool=$(build_prof_tool "$name" -O3)
  echo "== tools/prof/$name.cu $*"
  "$tool" "$@" 2>&1 | tee "$out/$name.txt"
}

cmd_sanitize() {
  [[ $# -eq 2 || $# -eq 4 ]] || usage
  local name=$1 tool=$2 dir cs report=${RACECHECK_REPORT:-analysis}
  dir=$(build_of "$name")
  [[ $tool =~ ^(memcheck|initcheck|synccheck|racecheck)$ ]] ||
    die "tool '$tool': memcheck, initcheck, synccheck or racecheck"
  [[ $report =~ ^(analysis|hazard|all)$ ]] ||
    die "RACECHECK_REPORT '$report': analysis, hazard or all"
  local tool_args=(--tool "$tool")
  [[ $tool == racecheck ]] && tool_args+=(--racecheck-report "$report")
  cs=$(command -v compute-sanitizer) || cs=""
  if [[ -z $cs ]]; then
    local candidate
    for candidate in /usr/local/cuda*/bin/compute-sanitizer; do
      [[ -x $candidate ]] && cs=$candidate && break
    done
  fi
  [[ -n $cs ]] || die "compute-sanitizer not found (PATH, /usr/local/cuda*/bin)"
  if [[ $tool == synccheck || $tool == racecheck ]]; then
    local patterns c
    patterns=$(build_prof_tool sanitizer_patterns -O2)
    echo "== $tool on tools/prof/sanitizer_patterns.cu (a case a process)"
    for c in 0 1 2 3 4 5 6 7 8 9 10 11 12 13; do
      "$cs" "${tool_args[@]}" --print-limit 1 "$patterns" "$c" >"$out/patterns-$tool-$c.txt" 2>&1 ||
        true
      echo "case $c: $(grep -m 1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/patterns-$tool-$c.txt")" \
        "$(grep -m 1 -oE 'Barrier error detected\. [^.]*\.|Race reported|[A-Z]{3} hazard detected' "$out/patterns-$tool-$c.txt")"
    done
  fi
  # The cases and their limits (s): together they launch every kernel family and tile.
  local runs=("decode_moe: served*|150" "moe_forward: reference shapes*|150"
    "moe_forward: the short-K*,moe_forward: the prefill tiles*|100"
    "append_shared: every size*,moe repack: GPU round trip*,moe route: workspace*|60")
  if [[ $# -eq 4 ]]; then
    [[ $4 =~ ^[1-9][0-9]*$ ]] || die "LIMIT_S '$4': a whole number of seconds"
    runs=("$3|$4")
  fi
  local run spec limit log rc i=0
  for run in "${runs[@]}"; do
    spec=${run%|*}
    limit=${run##*|}
    log=$out/sanitize-$tool-$name-$i.txt
    i=$((i + 1))
    rc=0
    (device_env "$name" && timeout --kill-after=5 "$limit" "$cs" "${tool_args[@]}" \
      --report-api-errors no --print-limit 200 --error-exitcode 99 \
      "$dir/moejit_gpu_tests" "$spec" -d yes) >"$log" 2>&1 || rc=$?
    echo "== $tool, '$spec': rc $rc$([[ $rc -eq 124 ]] && echo " (cut at $limit s)") ($(elapsed))"
    grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|All tests passed|^test cases:' "$log" | tail -n 3 || true
    # Each report's kind and place: the kernel (template arguments dropped) and the offset of
    # its instruction, to look up in the SASS of the kernel's cubin (cuobjdump -sass).
    awk '/^========= (Error|Invalid|Barrier|Uninitialized|Misaligned|Out of)/ {
        kind = $0; sub(/^========= /, "", kind); sub(/ at void .*/, "", kind)
        place = $0; if (place !~ / at void /) getline place
        if (match(place, /at void [^<(]+/)) {
          name = substr(place, RSTART + 8, RLENGTH - 8); off = ""
          if (match(place, /[+]0x[0-9a-f]+/)) off = substr(place, RSTART, RLENGTH)
          print kind " at " name off
        }
      }' "$log" | sort | uniq -c | sort -rn | head -n 12 || true
    # Hazard by hazard: each names the shared-memory address and the two threads' instructions.
    if [[ $tool == racecheck && $report != analysis ]]; then
      grep -m 8 -A 3 -E 'hazard detected' "$log" || true
    fi
  done
}

cmd_stalls() {
  [[ $# -ge 3 ]] || usage
  local name=$1 regex=$2 skip=$3 dir ncu
  shift 3
  dir=$(build_of "$name")
  ncu=$(command -v ncu) || ncu=""
  if [[ -z $ncu ]]; then
    local candidate
    for candidate in /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
      [[ -x $candidate ]] && ncu=$candidate && break
    done
  fi
  [[ -n $ncu ]] || die "ncu not found (PATH, /usr/local/cuda*/bin, /opt/nvidia/nsight-compute)"
  prewarm "$name"
  local report=$out/stalls-$name
  (device_env "$name" &&
    "$ncu" --clock-control none --kernel-name "$regex" --launch-skip "$skip" --launch-count 1 \
      --section WarpStateStats --section SourceCounters --section SchedulerStats \
      --section LaunchStats --section Occupancy --import-source no -o "$report" -f \
      "$dir/moejit_bench_moe" "$@") >"$report.log" 2>&1 || die "ncu failed: $report.log"
  "$ncu" --import "$report.ncu-rep" --page raw --csv >"$report.raw.csv"
  # The stall reasons (cycles per issued instruction) and the issue figures, one per line.
  python3 - "$report.raw.csv" >"$report.stalls.txt" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], newline="")))
# Row 0 names the metrics, row 1 gives their units, row 2 holds the launch's values.
header = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), 0)
names, values = rows[header], rows[header + 2]
for key, value in zip(names, values):
    if any(s in key for s in ("stall", "issue", "Kernel Name", "warps_active", "gpu__time_duration",
                              "occupancy", "launch__")):
        print(key, value)
PY
  "$ncu" --import "$report.ncu-rep" --page source --csv --print-source sass >"$report.source.csv"
  echo "== stalls of $regex (launch $skip), build $name ($(elapsed))"
  grep -E 'stall|issue' "$report.stalls.txt" | head -n 80 || true
  python3 "$root/tools/prof/ncu_loops.py" "$report.source.csv" --top 25 --hot 40
}

[[ $# -ge 1 ]] || usage
command=$1
shift
t0=$(date +%s)
case $command in
  stage) cmd_stage "$@" ;;
  suite | tables | ab | sanitize | stalls | probe)
    mkdir -p "$out"
    "cmd_$command" "$@"
    ;;
  -h | --help | help) usage 0 ;;
  *) die "unknown command '$command' (stage, suite, tables, ab, sanitize, stalls, probe; --help)" ;;
esac
