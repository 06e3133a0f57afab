#!/usr/bin/env bash
# torchvision beside the CPU torch, for vLLM's CPU engine: `cpu-torchvision.sh PYTHON`.
# vLLM's Qwen3-VL / Qwen3.5 module (chandra-ocr-2's architecture) imports torchvision
# unconditionally. PyPI's torchvision is a CUDA build; 0.28.0 loads beside the CPU torch once
# its nms/qnms fake registrations are guarded by _has_ops() like its other ops (without the
# guard, import fails with "operator torchvision::nms does not exist"). Idempotent; exits 1
# when torchvision still does not import. Used by scripts/setup.sh and scripts/install.sh.
set -euo pipefail
PYTHON="$1"
TORCHVISION_VERSION="0.28.0"
have="$("$PYTHON" -I -c "from importlib.metadata import version
try: print(version('torchvision'))
except Exception: print('')")"
if [[ "$have" != "$TORCHVISION_VERSION" ]]; then
    "$PYTHON" -m pip install -q --no-deps "torchvision==$TORCHVISION_VERSION"
fi
meta="$("$PYTHON" -I -c "import importlib.util as u
print(u.find_spec('torchvision').submodule_search_locations[0])")/_meta_registrations.py"
sed -i -E 's/^@torch\.library\.register_fake\(("torchvision::q?nms")\)$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))/' \
    "$meta"
if ! err="$("$PYTHON" -I -c "import torchvision, torchvision.transforms.v2" 2>&1)"; then
    printf '%s\n' "$err" >&2
    echo "import torchvision $TORCHVISION_VERSION fails beside this torch (patched $meta)" >&2
    exit 1
fi
