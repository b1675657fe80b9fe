#!/usr/bin/env bash
# Installs what gdnkit's build and tests need on a fresh Debian machine, and nothing when it is all there
# (idempotent: a second run only checks). Used by tools/test.sh and tools/bench.sh.
#
#   Debian packages: cmake (>= 3.24), ninja-build, g++, libgtest-dev (GoogleTest), python3 + pip
#   Python (pip):    scikit-build-core (>= 0.11), nanobind (the binding's build), numpy, pytest (its tests),
#                    PyTorch (the torch tests: torch_ops, the adapters; CPU use only, see below)
#
# The CUDA toolkit is not installed here: with nvcc present (PATH or /usr/local/cuda) the CUDA backend is
# built as well, without it the build is CPU-only (GDNKIT_CUDA=AUTO).
#   bash tools/install-deps.sh          what the build, the tests and the Python package need
#   bash tools/install-deps.sh build    only what building the library and the CLI needs (tools/bench.sh)
# GDNKIT_SKIP_PYTHON=1 skips the Python packages, GDNKIT_SKIP_TORCH=1 only PyTorch (its tests then skip,
# visibly). A GoogleTest install named by GTEST_ROOT (for machines without a package mirror) counts as installed.
#
# PyTorch: the only registry here is PyPI, whose Linux wheels are CUDA builds: torch (540 MB) and its CUDA
# libraries (nvidia-*, about 3 GB more; torch does not import without them, even for CPU use). Measured on a
# 2-core machine: 4 minutes, 5 GB installed. It is installed once per machine (present: nothing to do).
set -euo pipefail
mode=${1:-all}
export DEBIAN_FRONTEND=noninteractive

log() { echo "[install-deps] $*"; }

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo_cmd=(sudo -n); else log "not root and no sudo: apt-get may fail"; fi
fi

# ---- Debian packages -------------------------------------------------------------------------------
# Each package with the file that shows it is installed (a tool may come from elsewhere, e.g. pyenv).
missing=()
need_pkg() {  # need_pkg PACKAGE TEST-COMMAND...
  local pkg=$1; shift
  if ! "$@" >/dev/null 2>&1; then missing+=("$pkg"); fi
}
need_pkg cmake       command -v cmake
need_pkg ninja-build command -v ninja
need_pkg g++         command -v g++
if [ "$mode" = all ] && [ ! -f "${GTEST_ROOT:-/nonexistent}/include/gtest/gtest.h" ]; then
  need_pkg libgtest-dev test -f /usr/include/gtest/gtest.h
fi
[ "$mode" = all ] && need_pkg python3 command -v python3
if [ "$mode" = all ] && [ "${GDNKIT_SKIP_PYTHON:-0}" != 1 ] && command -v python3 >/dev/null 2>&1; then
  need_pkg python3-pip python3 -m pip --version
  need_pkg python3-dev python3 -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
fi
# libgtest-dev ships the static libraries on Debian 12; older ones shipped only the sources.
have_gtest_lib=0
for f in /usr/lib/*/libgtest.a /usr/lib/libgtest.a; do [ -f "$f" ] && have_gtest_lib=1; done
if [ "$mode" = all ] && [ -z "${GTEST_ROOT:-}" ] && [ -f /usr/include/gtest/gtest.h ] && [ $have_gtest_lib = 0 ] && [[ ! " ${missing[*]} " =~ " libgtest-dev " ]]; then
  missing+=(libgtest-dev)
fi

if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  log "Debian packages: all present"
fi

# CMake >= 3.24 is required by CMakeLists.txt (Debian 12 has 3.25).
cmake_version=$(cmake --version | head -1 | awk '{print $3}')
if ! printf '3.24\n%s\n' "$cmake_version" | sort -V -C; then
  log "cmake $cmake_version is older than 3.24: installing a newer cmake from PyPI"
  python3 -m pip install -q "cmake>=3.24"
fi

# ---- Python packages -------------------------------------------------------------------------------
if [ "$mode" = all ] && [ "${GDNKIT_SKIP_PYTHON:-0}" != 1 ]; then
  # module name -> requirement
  py_missing=()
  for pair in "nanobind:nanobind>=2.0" "numpy:numpy" "pytest:pytest"; do
    mod=${pair%%:*}
    req=${pair#*:}
    python3 -c "import $mod" >/dev/null 2>&1 || py_missing+=("$req")
  done
  # pyproject.toml's license metadata (PEP 639) needs scikit-build-core 0.11.
  at_least() {  # at_least MODULE MAJOR MINOR: the module imports and its __version__ is >= MAJOR.MINOR
    python3 -c "import sys, $1 as m; v = m.__version__.split('+')[0].split('.')
sys.exit((int(v[0]), int(v[1])) < ($2, $3))" >/dev/null 2>&1
  }
  at_least scikit_build_core 0 11 || py_missing+=("scikit-build-core>=0.11")
  # Debian's system Python refuses pip installs (PEP 668) unless told otherwise; a venv or pyenv does not.
  pip_flags=()
  if python3 -m pip install --help 2>/dev/null | grep -q -- --break-system-packages; then
    pip_flags+=(--break-system-packages)
  fi
  if [ ${#py_missing[@]} -gt 0 ]; then
    log "pip install ${py_missing[*]}"
    python3 -m pip install -q "${pip_flags[@]}" "${py_missing[@]}"
  else
    log "Python packages: all present"
  fi

  if [ "${GDNKIT_SKIP_TORCH:-0}" = 1 ]; then
    log "PyTorch: skipped (GDNKIT_SKIP_TORCH=1): the torch tests will skip"
  elif at_least torch 2 4; then
    log "PyTorch: present ($(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null))"
  else
    t0=$(date +%s)
    log "pip install torch (for the torch tests, run on the CPU): PyPI's wheel with its CUDA libraries, about" \
        "3.5 GB to download and 4 minutes on 2 cores, once per machine"
    python3 -m pip install -q "${pip_flags[@]}" "torch>=2.4"
    python3 -c "import torch; torch.zeros(1) + 1"
    log "PyTorch $(python3 -c 'import torch; print(torch.__version__)') installed in $(( $(date +%s) - t0 )) s"
  fi
  # transformers (pure Python) for the integration's tests: Qwen3-Next from 4.57
  if [ "${GDNKIT_SKIP_TORCH:-0}" != 1 ] && ! at_least transformers 4 57; then
    log "pip install transformers (the integration's tests)"
    python3 -m pip install -q "${pip_flags[@]}" "transformers>=4.57"
  fi
fi
