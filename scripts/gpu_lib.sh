# Functions of scripts/gpu.sh that more than one mode shares, sourced by it (and by tests/test_gpu_script.py, which
# runs them on their own). The caller sets LOG (the mode's log file) and mode; train_or_resume also needs gpu.sh's
# `run`. Run from the repository root (python3 -m harness...).

say() { echo "$*" | tee -a "$LOG"; }
die() { say "gpu.sh $mode: $*"; exit 2; }

gather_pieces() {   # NAME SRC DEST [LABEL]: a file carried in pieces (python -m harness.core.pieces split), one or more
  # a call (the tree plus all of them can pass 64 MiB): SRC/NAME.pieces.json and SRC/NAME.partNNN are copied to DEST,
  # where they gather across the calls of one machine. With fewer pieces than the manifest lists: says
  # "LABEL: N of M pieces on this machine" and ends the call (exit 0). With all of them: joins DEST/NAME (every
  # piece's and the whole file's size and sha256 checked) and returns; a failed join dies "bad bundle in SRC".
  local name=$1 src=$2 dest=$3 label=${4:-bundle} want have
  mkdir -p "$dest"
  cp "$src/$name.pieces.json" "$src/$name".part* "$dest/" 2>/dev/null
  want=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))['pieces']))" "$dest/$name.pieces.json") \
    || die "bad bundle in $src"
  have=$(ls "$dest/$name".part* 2>/dev/null | wc -l)
  if [ "$have" -lt "$want" ]; then say "$label: $have of $want pieces on this machine"; exit 0; fi
  python3 -m harness.core.pieces join "$dest/$name" || die "bad bundle in $src"
}

train_or_resume() {   # HEAD RESUME_S ARGS...: `ppspec train-draft` as the `run` step "train" (560 s): with a checkpoint
  # in HEAD on this machine (HEAD/checkpoint/state.pt: from this sitting, or joined from a carried bundle) resume it
  # for RESUME_S seconds of training (Adam's moments as the checkpoint holds them); else a fresh run with ARGS
  # (its --config, --out HEAD, --time-budget, the mode's --set ARGS). Returns run's exit status.
  local head=$1 resume_s=$2
  shift 2
  if [ -f "$head/checkpoint/state.pt" ]; then
    run train 560 python3 -m harness train-draft --resume "$head" --time-budget "$resume_s" --no-progress
  else
    run train 560 python3 -m harness train-draft "$@"
  fi
}
