#!/usr/bin/env bash
# One call on a lent GPU machine: install archlab and the carried wheels beside the image's torch, show the machine,
# then run the steps asked for, each under its own time limit, writing logs and tables under $OUT.
#
#   bash scripts/gpu/session.sh [--dry-run] STEP...
#
# Steps (setup and info always run first; each later step runs even when an earlier one failed):
#   setup   install .whl/*.whl (once per machine) and this checkout (every call) into $SITE, no network
#   info    nvidia-smi, versions, where each package is imported from, unmet requirements
#   headline --suite cuda-headline: the issues' headline rows (batch-1 static decoding, the 2048-token prefill,
#           dense training eager and compiled), each with its goal (105 s on an H100): a first session's numbers
#   kernels --suite cuda-kernels: archlab's Triton kernels alone against the PyTorch paths they would replace, each
#           as N calls in one CUDA graph (µs per call, % of the bandwidth, the split and autotuned blocks chosen),
#           first a decoder layer's step fused vs the default's: seconds per row (plus their compiles), where a
#           tuning row takes a minute
#   tests   pytest -m gpu over the test files that mark a test gpu or check torch.cuda.is_available(), in
#           GPU_TEST_WORKERS processes at once (one process took over 5 minutes: on an H100 28 of the 50 GPU tests ran
#           in 300 s, each compiling its steps on the CPU; 78 in 4 processes took ~4 minutes on an H200); they
#           print one line per test as it ends and each failure's traceback at once, so a run stopped at its limit
#           says which passed and why others failed; then the kernel test files' other tests, which run the
#           kernels on the GPU where there is one (`runs_kernels`)
#   cputests pytest -m "not gpu and not slow" over the same files, on the image's torch (they ran after the GPU tests
#           in `tests` until an H200 session spent its call's last 4 minutes on them: a step of its own now)
#   quick   every CUDA suite at --quick size with the real liger-kernel, tables only (about 2-3 minutes)
#   train   --suite cuda-train      (about 5-8 minutes, a call of its own)
#   compiled --suite cuda-train-compiled (vocab 128256, MoE, seq2seq compiled regionally; about 6-8 minutes)
#   decode  --suite cuda-decode     (about 3-5 minutes; fits in a call after tests)
#   static  --suite cuda-static     (about 5-8 minutes: compiles per batch size; a call of its own)
#   loops   --suite cuda-loops      (about 6-7 minutes: sampling, the loop's gain, MoE, beam search, rings, all compiled)
#   tuning  --suite cuda-tuning     (settings of the decoding step against the default: max-autotune's tuned GEMVs,
#           the memory-efficient attention, both, at batch 1; max-autotune at batch 16; each row compiles twice)
#   catalogue --suite cuda-catalogue: GPT-OSS-, DeepSeek-V3- and Llama-4-shaped models decoding on the static cache
#           against their stock models (batch 1 and 16, each row compiling both sides; a call of its own)
#   profile scripts/profile_cuda.py: where the GPU time goes in training (dense compiled and eager, MoE, seq2seq),
#           the prefill (eager and compiled) and decoding at batch 1 and 64 — kernel time by kind, idle share,
#           top kernels (189 s on an H100); PROFILE_WORKLOADS="train-moe decode-1" profiles only those
# The calls of a session, and what the times are based on: docs/gpu.md.
#
# Environment: OUT (default ./gpu-out; the device tool sets it), SITE (/tmp/site), WHEEL_DIR (.whl),
# PYTHON (python3), SESSION_BUDGET (seconds for the whole call, default 570: the device tool stops a command at 600),
# GPU_TEST_WORKERS (pytest processes the `tests` step runs the GPU tests in at once, default 4),
# STEP_LIMIT (seconds, replaces every step's own limit), DEVICE (cuda; `cpu` rehearses a session on a machine
# without a GPU), PROFILE_WORKLOADS (the profile step's workloads, space-separated; default every one).
# Files under $OUT: session.log (everything), steps.tsv (step, status, seconds), one markdown table per suite.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2

OUT="${OUT:-./gpu-out}"
SITE="${SITE:-/tmp/site}"
WHEEL_DIR="${WHEEL_DIR:-.whl}"
PYTHON="${PYTHON:-python3}"
PROFILE_WORKLOADS="${PROFILE_WORKLOADS:-}"
GPU_TEST_WORKERS="${GPU_TEST_WORKERS:-4}"
SESSION_BUDGET="${SESSION_BUDGET:-570}"
DEVICE="${DEVICE:-cuda}"
STEPS_ALLOWED="setup info headline kernels tests cputests quick train compiled decode static loops tuning catalogue profile"
# Each step's own limit in seconds; a step also stops where the session's budget ends.
declare -A BUDGET=([setup]=120 [info]=60 [headline]=480 [kernels]=240 [tests]=540 [cputests]=540 [quick]=240 [train]=540 [compiled]=540 [decode]=540 [static]=540 [loops]=540 [tuning]=540 [catalogue]=540 [profile]=540)

dry_run=0
requested=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        -h | --help) sed -n '2,42p' "$0"; exit 0 ;;
        *)
            if [[ " $STEPS_ALLOWED " != *" $arg "* ]]; then
                echo "error: unknown step '$arg'; allowed: $STEPS_ALLOWED" >&2
                exit 2
            fi
            requested+=("$arg") ;;
    esac
done
steps=(setup info)
for step in "${requested[@]}"; do
    [[ " ${steps[*]} " == *" $step "* ]] || steps+=("$step")
done

mkdir -p "$OUT"
LOG="$OUT/session.log"
SUMMARY="$OUT/steps.tsv"
START=$SECONDS
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PIP_DISABLE_PIP_VERSION_CHECK=1
BENCHMARK=("$PYTHON" -m archlab.scripts.benchmark --device "$DEVICE")

say() { echo "[$(date +%H:%M:%S) +$((SECONDS - START))s] $*" | tee -a "$LOG"; }

# ---- the steps' commands ----------------------------------------------------------------------------------------
step_setup() {
    shopt -s nullglob
    local wheels=("$WHEEL_DIR"/*.whl)
    shopt -u nullglob
    if ((${#wheels[@]} == 0)); then
        echo "no wheels in $WHEEL_DIR: run 'bash scripts/gpu/fetch_wheels.sh' where PyPI is reachable, and carry .whl"
        return 1
    fi
    local stamp
    stamp=$(sha256sum "${wheels[@]}" | sha256sum | cut -c1-16)
    if [[ -f "$SITE/.wheels-$stamp" ]]; then
        echo "wheels already installed in $SITE ($stamp)"
    else
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${wheels[@]}" || return 1
        touch "$SITE/.wheels-$stamp"
    fi
    # archlab itself on every call: the checkout may have changed since the last one. Should the image's setuptools
    # fail to build it, lay out the package by hand as pyproject's package-dir maps it (no metadata, same code).
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
        --target "$SITE" .; then
        echo "pip could not build archlab here: copying the package folders into $SITE/archlab instead"
        rm -rf "$SITE/archlab" && cp -r src/archlab "$SITE/archlab" || return 1
        local folder
        for folder in modeling configuration conversion tokenization scripts model_cards training; do
            cp -r "$folder" "$SITE/archlab/$folder" || return 1
        done
    fi
    "$PYTHON" -c "import archlab, transformers; print('archlab from', archlab.__file__, '| transformers', transformers.__version__)"
}

step_info() {
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
    "$PYTHON" scripts/gpu/environment.py
}

# Every pytest here runs in one process (-p no:xdist): tests/conftest.py would start a pytest-xdist worker per core
# (16 here) where the image has pytest-xdist, on top of the `tests` step's own GPU_TEST_WORKERS processes.
step_tests() {
    local files
    mapfile -t files < <(grep -rlE "cuda\.is_available|mark\.gpu" tests --include='test_*.py' | sort)
    if ((${#files[@]} == 0)); then
        echo "no test file checks for CUDA"
        return 0
    fi
    local status=0 kernel_files
    gpu_tests "${files[@]}" || status=1
    # the kernel test files' other tests run the kernels on the GPU here (`runs_kernels`); the files' rest: `cputests`
    mapfile -t kernel_files < <(grep -rl "runs_kernels" tests --include='test_*.py' | sort)
    "$PYTHON" -m pytest -q --tb=short -p no:cacheprovider -p no:xdist -m "not gpu and not slow" "${kernel_files[@]}" || status=1
    return $status
}

step_cputests() {  # the CPU tests of the files `tests` runs, on the image's torch (the same versions run on CPU too)
    local files
    mapfile -t files < <(grep -rlE "cuda\.is_available|mark\.gpu" tests --include='test_*.py' | sort)
    "$PYTHON" -m pytest -q --tb=short -p no:cacheprovider -p no:xdist -m "not gpu and not slow" "${files[@]}"
}

# gpu_tests FILE...: their GPU tests dealt round-robin to GPU_TEST_WORKERS pytest processes run at once. Each test
# spends most of its time compiling on the CPU (28 of 50 tests in 300 s, one process, on the first H100 session),
# and the machine has 16 cores; the GPU holds several processes' tiny models. Each worker's log is printed when all
# have ended, or when the step is stopped at its limit (the workers are stopped too).
gpu_tests() {
    local ids pids=() logs=() worker index status=0 folder stopping=0
    mapfile -t ids < <("$PYTHON" -m pytest --collect-only -q -p no:cacheprovider -p no:xdist -m gpu "$@" 2>/dev/null | grep '::')
    echo "${#ids[@]} GPU tests in $GPU_TEST_WORKERS processes"
    ((${#ids[@]})) || return 0
    folder=$(mktemp -d)
    # shellcheck disable=SC2317,SC2329  # (reached through the trap)
    stop_workers() {
        # once: coreutils' timeout signals the step twice (the process, then its process group), and a second TERM
        # handled after the first printed the logs printed them again (a CI run found each worker's output twice)
        ((stopping)) && return
        stopping=1
        # further TERMs ignored, by this shell and by the `cat` below (which inherits it): timeout's second TERM, to
        # the whole process group, killed a `cat` printing the logs (a loaded 2-core machine: the workers' output lost)
        trap '' TERM INT
        kill "${pids[@]}" 2>/dev/null
        wait
        cat "${logs[@]}" 2>/dev/null
        exit 124
    }
    trap stop_workers TERM INT
    for ((worker = 0; worker < GPU_TEST_WORKERS; worker++)); do
        local chunk=()
        for ((index = worker; index < ${#ids[@]}; index += GPU_TEST_WORKERS)); do chunk+=("${ids[index]}"); done
        ((${#chunk[@]})) || continue
        logs+=("$folder/worker-$worker.log")
        # each failure's traceback as the test ends (tests/conftest.py): a step stopped at its limit still says why
        ARCHLAB_TEST_FAILURES_AT_ONCE=1 "$PYTHON" -m pytest -v --tb=short -p no:cacheprovider -p no:xdist -m gpu "${chunk[@]}" \
            >"$folder/worker-$worker.log" 2>&1 &
        pids+=($!)
    done
    for index in "${!pids[@]}"; do
        wait "${pids[index]}" || status=1
    done
    trap - TERM INT
    cat "${logs[@]}"
    return $status
}

suite() {  # suite NAME OUTPUT [flags...]: one benchmark run, its table written to $OUT/OUTPUT
    local name=$1 output=$2
    shift 2
    "${BENCHMARK[@]}" --suite "$name" --output "$OUT/$output" "$@"
}

step_quick() {
    local status=0
    for name in cuda-train cuda-train-compiled cuda-decode cuda-static cuda-loops cuda-tuning cuda-kernels cuda-catalogue; do  # one process each, as in full
        suite "$name" "quick-$name.md" --quick || status=1
    done
    return $status
}
step_headline() { suite cuda-headline cuda-headline.md; }
step_kernels() { suite cuda-kernels cuda-kernels.md; }
step_train() { suite cuda-train cuda-train.md; }
step_compiled() { suite cuda-train-compiled cuda-train-compiled.md; }
step_decode() { suite cuda-decode cuda-decode.md; }
step_static() { suite cuda-static cuda-static.md; }
step_loops() { suite cuda-loops cuda-loops.md; }
step_tuning() { suite cuda-tuning cuda-tuning.md; }
step_catalogue() { suite cuda-catalogue cuda-catalogue.md; }
step_profile() {
    local flags=() name
    for name in $PROFILE_WORKLOADS; do flags+=(--workload "$name"); done
    "$PYTHON" -m archlab.scripts.profile_cuda --device "$DEVICE" --output "$OUT/profile.md" "${flags[@]}"
}

# ---- running them -----------------------------------------------------------------------------------------------
run_step() {
    local step=$1 left limit started status
    left=$((SESSION_BUDGET - (SECONDS - START) - 10))
    limit=${STEP_LIMIT:-${BUDGET[$step]}}
    ((left < limit)) && limit=$left
    if ((left < 20)); then
        say "== $step: skipped, ${left}s left of the session's ${SESSION_BUDGET}s"
        printf '%s\tskipped\t0\n' "$step" >>"$SUMMARY"
        return
    fi
    if ((dry_run)); then
        say "== $step: would run step_$step under timeout ${limit}s"
        declare -f "step_$step" | sed '1,2d;$d' | tee -a "$LOG"
        printf '%s\tdry-run\t0\n' "$step" >>"$SUMMARY"
        return
    fi
    say "== $step: start (limit ${limit}s)"
    started=$SECONDS
    # A subshell under timeout: the step's functions and variables come along, and a hung step is killed.
    timeout --kill-after=15 "$limit" bash -c "$(declare -f); $(declare -p PYTHON SITE WHEEL_DIR OUT BENCHMARK DEVICE PROFILE_WORKLOADS GPU_TEST_WORKERS); step_$step" \
        >>"$LOG" 2>&1
    status=$?
    local seconds=$((SECONDS - started)) verdict=ok
    ((status == 124 || status == 137)) && verdict="timed out"
    ((status != 0)) && [[ $verdict == ok ]] && verdict="failed (exit $status)"
    say "== $step: $verdict after ${seconds}s"
    printf '%s\t%s\t%s\n' "$step" "$verdict" "$seconds" >>"$SUMMARY"
}

: >"$SUMMARY"
say "archlab GPU session: steps ${steps[*]}; OUT=$OUT SITE=$SITE WHEEL_DIR=$WHEEL_DIR budget ${SESSION_BUDGET}s"
for step in "${steps[@]}"; do
    run_step "$step"
done

# What the device tool's reply shows (the end of the output): the tables, then each step's verdict.
for table in "$OUT"/*.md; do
    [[ -f $table && $table != "$OUT/profile.md" ]] && { echo; cat "$table"; }
done
if [[ -f "$OUT/profile.md" ]]; then  # each workload's head (wall, busy share, kinds), not its top kernels: the file
    echo                              # comes back whole
    awk '/^## /{show=1} /^\| kernel \|/{show=0} show' "$OUT/profile.md"
fi
echo
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
! grep -qv $'\tok\t\|\tdry-run\t' "$SUMMARY"
