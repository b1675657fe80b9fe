#!/usr/bin/env bash
# Installs what gdnkit's build and tests need on a fresh Debian machine, and nothing when it is all there
# (idempotent: a second run only checks). Used by tools/test.sh and tools/bench.sh.
#
#   Debian packages: cmake (>= 3.24), ninja-build, g++, libgtest-dev (GoogleTest), python3 + pip
#   Python (pip):    scikit-build-core, nanobind (the binding's build), numpy, pytest (its tests)
#
# The CUDA toolkit is not installed here: with nvcc present (PATH or /usr/local/cuda) the CUDA backend is
# built as well, without it the build is CPU-only (GDNKIT_CUDA=AUTO).
#   bash tools/install-deps.sh          what the build, the tests and the Python package need
#   bash tools/install-deps.sh build    only what building the library and the CLI needs (tools/bench.sh)
# GDNKIT_SKIP_PYTHON=1 skips the Python packages. A GoogleTest install named by GTEST_ROOT (for machines
# without a package mirror) counts as installed.
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
  for pair in "scikit_build_core:scikit-build-core>=0.10" "nanobind:nanobind>=2.0" "numpy:numpy" "pytest:pytest"; do
    mod=${pair%%:*}
    req=${pair#*:}
    python3 -c "import $mod" >/dev/null 2>&1 || py_missing+=("$req")
  done
  if [ ${#py_missing[@]} -gt 0 ]; then
    log "pip install ${py_missing[*]}"
    # Debian's system Python refuses pip installs (PEP 668) unless told otherwise; a venv or pyenv does not.
    pip_flags=()
    if python3 -m pip install --help 2>/dev/null | grep -q -- --break-system-packages; then
      pip_flags+=(--break-system-packages)
    fi
    python3 -m pip install -q "${pip_flags[@]}" "${py_missing[@]}"
  else
    log "Python packages: all present"
  fi
fi
