#!/usr/bin/env bash
# The reference run on a lent GPU, in one call well inside 10 minutes:
#   versions and capability; the CUDA-only tests; the attention probe (tests/gpu_probe.py);
#   --quick, the default run, --arch post --experiments AB and A on a mixture of experts, each
#   into its own folder;
#   then at most 8 files copied flat into $OUT to bring back.
#
#   OUT=somewhere bash tests/gpu_check.sh            # on the GPU machine
#   OUT=somewhere bash tests/gpu_check.sh --dry-run  # print the plan, run nothing
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT="${OUT:-gpu_check_out}"
WORK="${GPU_CHECK_WORK:-/tmp/gpu_check}"
mkdir -p "$OUT" "$WORK"
LOG="$OUT/gpu_check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
BUDGET=0   # seconds the steps may take in all (the sum of their timeouts)
GRACE=5    # a step is sent SIGTERM this long before its timeout, SIGKILL at it
FAILED=()
STOP=0     # SIGTERM or SIGINT to this script: the step running ends, no other starts
trap 'STOP=1' TERM INT

step() {  # step NAME TIMEOUT_S COMMAND...: run it (or, dry, print it), teeing into the log
  local name="$1" limit="$2"
  shift 2
  BUDGET=$((BUDGET + limit))
  echo "== $name (timeout ${limit} s): $*" | tee -a "$LOG"
  [[ $DRY == 1 ]] && return 0
  if [[ $STOP == 1 ]]; then
    echo "== $name: not run (interrupted)" | tee -a "$LOG"
    FAILED+=("$name (not run)")
    return 0
  fi
  local t0=$SECONDS
  # SIGTERM first: NN_40_serving.py stops as after Ctrl-C and writes its results.json. In this
  # script's process group (--foreground), so a signal to the group reaches it too; tee
  # ignores it, so that what the run prints as it stops still has somewhere to go
  timeout --foreground -k "$GRACE" "$((limit - GRACE))" "$@" 2>&1 | \
    (trap '' TERM INT; exec tee -a "$LOG")
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [[ $rc == 0 ]] || FAILED+=("$name ($rc)")
}

step versions 30 "$PY" -c "import torch, platform; print('python', platform.python_version(), \
'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version()); \
print(torch.cuda.get_device_name(0), 'capability', torch.cuda.get_device_capability(0), \
'arch list', torch.cuda.get_arch_list())"
step cuda-tests 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_roofline.py \
  tests/test_engine.py tests/test_portability.py -k "cuda"
step attention-probe 45 "$PY" tests/gpu_probe.py --device cuda
step quick 60 "$PY" NN_40_serving.py --quick --out "$WORK/quick"
step default 200 "$PY" NN_40_serving.py --out "$WORK/default"
step post-proxy 45 "$PY" NN_40_serving.py --arch post --experiments AB --out "$WORK/post"
# a mixture of experts beside its dense twin (a quarter of Qwen3-30B-A3B's layers, 15 GB): the
# curve C prices for a GPU, measured; one mode, graphs where the MoE step can be captured
# (each row says which it ran in; its twin runs in the same), eager where it cannot (the
# loop over experts: about 0.1-0.2 s a step, near 30 s of work at these shapes)
step moe 70 "$PY" NN_40_serving.py --experiments A --model qwen3-30b-a3b --layers 12 \
  --graphs on --batch-sizes 1,4,16,64,256 --contexts 512 --context 512 --reps 20 \
  --out "$WORK/moe"

# what comes back: the four results.json, the log, three figures of the default run
BRING=("quick/results.json:quick_results.json" "default/results.json:default_results.json"
       "post/results.json:post_results.json" "moe/results.json:moe_results.json"
       "default/decode_batch.png:decode_batch.png" "default/roofline.png:roofline.png"
       "default/engine.png:engine.png")
echo "== bring back (with the log, $(( ${#BRING[@]} + 1 )) files): ${BRING[*]}" | tee -a "$LOG"
echo "== steps' timeouts add up to ${BUDGET} s" | tee -a "$LOG"
if [[ $DRY == 0 ]]; then
  for pair in "${BRING[@]}"; do
    [[ -f "$WORK/${pair%%:*}" ]] && cp "$WORK/${pair%%:*}" "$OUT/${pair##*:}"
  done
fi
if (( ${#FAILED[@]} )); then
  echo "== failed: ${FAILED[*]}" | tee -a "$LOG"
  exit 1
fi
echo "== done" | tee -a "$LOG"
