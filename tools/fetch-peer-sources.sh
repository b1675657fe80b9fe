#!/usr/bin/env bash
# Writes the released sources of the peers' GDN ops that the adapter tests compare against, for machines where
# the peer package itself does not install (tests/python/peer_sources.py loads them from there).
#
#   bash tools/fetch-peer-sources.sh DIR      then: GDNKIT_PEER_SOURCES=DIR pytest tests/python
#
# Needs network access to PyPI (run it where there is some and copy DIR over). What lands in DIR, each peer's
# files unchanged with its licence:
#   vllm/third_party/flash_linear_attention/   vLLM 0.33.0's FLA-derived ops (from its source distribution)
#   sglang/kernels/ops/attention/linear/       SGLang 0.5.23's fused_sigmoid_gating_recurrent.py (from its wheel)
# The versions are those the adapters pin (python/gdnkit/adapters/).
set -euo pipefail
dest=${1:?usage: tools/fetch-peer-sources.sh DIR}
VLLM=0.33.0
SGLANG=0.5.23
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# vLLM: the sdist (the wheel is a 400 MB CUDA build); pip cannot download an sdist without building its metadata.
url=$(curl -fsSL https://pypi.org/simple/vllm/ | grep -o "https://[^\"#]*/vllm-$VLLM\.tar\.gz" | head -1)
[ -n "$url" ] || { echo "fetch-peer-sources: vllm-$VLLM.tar.gz not found on PyPI" >&2; exit 1; }
echo "[fetch-peer-sources] $url"
curl -fsSL -o "$tmp/vllm.tar.gz" "$url"
tar -xzf "$tmp/vllm.tar.gz" -C "$tmp" "vllm-$VLLM/vllm/third_party/flash_linear_attention" "vllm-$VLLM/LICENSE"
mkdir -p "$dest/vllm/third_party"
rm -rf "$dest/vllm/third_party/flash_linear_attention"
cp -r "$tmp/vllm-$VLLM/vllm/third_party/flash_linear_attention" "$dest/vllm/third_party/"
cp "$tmp/vllm-$VLLM/LICENSE" "$dest/vllm/LICENSE"

# SGLang: one module of its wheel (pure Python).
echo "[fetch-peer-sources] sglang==$SGLANG"
python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.11 "sglang==$SGLANG" -d "$tmp"
whl=$(ls "$tmp"/sglang-"$SGLANG"-*.whl | head -1)
python3 - "$whl" "$dest" <<'EOF'
import sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
want = "sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py"
with zipfile.ZipFile(whl) as z:
    names = z.namelist()
    lic = [n for n in names if n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")]
    z.extract(want, dest)
    if lic:
        open(f"{dest}/sglang/LICENSE", "wb").write(z.read(lic[0]))
EOF
echo "[fetch-peer-sources] wrote $dest: $(find "$dest" -name '*.py' | wc -l) Python files"
