#!/usr/bin/env bash
# One call on a GPU machine that has only this working tree: check the Triton kernels, time and
# tune them against cuBLAS / torch._grouped_mm / SDPA-flash, and train a Mixtral-layout model
# (configs/mixtral-h200.yaml) with the kernels on and off and in FP8, reporting tokens/s, MFU and memory.
#
#   OUT=results bash bench/gpu_check.sh                 # every section, ~6-8 minutes on an H200
#   OUT=results bash bench/gpu_check.sh kernels train   # some sections
#   OUT=results bash bench/gpu_check.sh --dry-run       # CPU, toy sizes: tests the plumbing
#
# Sections: env plan (the planner's step time: data sheet, and this GPU calibrated) tests kernels train (train_eager train_torch train_compiled train_fp8) fp8_loss (100 steps
# of FP8 against bf16 on the same data, 2 layers of the model) — each under its
# own time limit, so one that hangs costs its limit, not the call. After every section
# $OUT/gpu_check.json, $OUT/gpu_check.md and $OUT/logs.txt are rewritten with what is known,
# so a call cut short still returns the finished sections.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY=0
SECTIONS=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        env|plan|tests|kernels|train_eager|train_torch|train_compiled|train_fp8|fp8_loss) SECTIONS+=("$arg") ;;
        train) SECTIONS+=(train_eager train_torch train_compiled train_fp8) ;;
        *) echo "gpu_check.sh: unknown argument '$arg'; expected --dry-run or sections among:" \
                "env plan tests kernels train train_eager train_torch train_compiled train_fp8 fp8_loss" >&2; exit 2 ;;
    esac
done
# The headline first (MFU in bf16 and FP8), so a call cut short still has it.
[[ ${#SECTIONS[@]} -eq 0 ]] && SECTIONS=(env plan train_eager train_fp8 kernels train_torch train_compiled fp8_loss tests)
[[ " ${SECTIONS[*]} " == *" env "* ]] || SECTIONS=(env "${SECTIONS[@]}")

OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
# `import moetron` without pip (the GPU machine has no registry): the package is this folder.
mkdir -p "$WORK/pkg" && ln -s "$ROOT" "$WORK/pkg/moetron"
export PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# Packages the GPU machine cannot download (it has no registry): `make gpu-wheels` puts their wheels
# in bench/wheels/ (ignored by git, carried with the working tree); installed under $WORK for this call.
if compgen -G "bench/wheels/*.whl" >/dev/null; then
    "$PY" -m pip install --quiet --no-index --no-deps --target "$WORK/site" bench/wheels/*.whl &&
        export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi
if [[ $DRY == 1 ]]; then
    export TRITON_INTERPRET=1
    CONFIG=(configs/tiny.yaml train.batch_size=2 train.seq_len=64 train.precision=fp32)
    STEPS=(--steps 1 --warmup 0)
    LOSS_STEPS=2
    PROFILE=(--profile H100)  # the plumbing: a CPU has no GPU profile to start from
    TESTS=(tests/kernels -k "checks_arguments")
    KERNEL_ARGS=(--dry-run --tune --rep-ms 5)
else
    CONFIG=(configs/mixtral-h200.yaml)
    STEPS=(--steps 30 --warmup 3)
    LOSS_STEPS=100
    PROFILE=()
    TESTS=(tests/kernels)
    KERNEL_ARGS=(--rep-ms 25 --seq-lens 4096 8192 ${TUNE:+--tune})
fi

report() {
    "$PY" bench/gpu_check.py report --work "$WORK" --out "$OUT" >/dev/null 2>>"$WORK/report.err" ||
        echo "gpu_check.sh: the report failed (see $WORK/report.err)" >&2
}

run_section() {  # name, time limit in seconds, command...
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    echo "{\"section\": \"$name\", \"rc\": $rc, \"seconds\": $(($(date +%s) - start)), \"limit\": $limit}" >>"$WORK/sections.jsonl"
    tail -n 8 "$WORK/$name.log"
    echo "== $name: exit $rc after $(($(date +%s) - start))s"
    report
}

for section in "${SECTIONS[@]}"; do
    case "$section" in
        env) run_section env 90 "$PY" bench/gpu_check.py env --json "$WORK/env.json" ;;
        plan) run_section plan 60 "$PY" bench/gpu_check.py plan "${CONFIG[@]}" --env "$WORK/env.json" "${PROFILE[@]}" \
                  --json "$WORK/plan.json" ;;
        tests) run_section tests 150 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" \
                   --junitxml="$WORK/tests.xml" ;;
        kernels) run_section kernels 170 "$PY" bench/kernel_speed.py "${KERNEL_ARGS[@]}" --json "$WORK/kernels.json" ;;
        train_eager) run_section train_eager 100 "$PY" bench/mfu.py "${CONFIG[@]}" train.compile=false \
                         "${STEPS[@]}" --json "$WORK/train_eager.json" ;;
        train_torch) run_section train_torch 100 "$PY" bench/mfu.py "${CONFIG[@]}" train.compile=false \
                         model.attention=sdpa kernel.backend=torch "${STEPS[@]}" --json "$WORK/train_torch.json" ;;
        train_fp8) run_section train_fp8 100 "$PY" bench/mfu.py "${CONFIG[@]}" train.compile=false \
                       train.precision=fp8 "${STEPS[@]}" --json "$WORK/train_fp8.json" ;;
        fp8_loss) run_section fp8_loss 150 "$PY" bench/fp8_loss.py "${CONFIG[@]}" model.n_layers=2 \
                      --steps "${LOSS_STEPS}" --json "$WORK/fp8_loss.json" ;;
        train_compiled) run_section train_compiled 200 "$PY" bench/mfu.py "${CONFIG[@]}" train.compile=true \
                            "${STEPS[@]}" --json "$WORK/train_compiled.json" ;;
    esac
done
report
cat "$OUT/gpu_check.md" 2>/dev/null
