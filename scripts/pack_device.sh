#!/usr/bin/env bash
# Packs what bench/gpu_check.sh needs on a GPU machine that has no network: DIR (default .device, which must be
# git-ignored: `echo /.device/ >> .git/info/exclude`) gets
#   whl/                  cp312 manylinux x86-64 wheels of every import dependency of the project (tensordict,
#                         fastapi, pydantic, ...) and of SGLang's receive code (scripts/install_sglang.sh DEPS) that
#                         the GPU image lacks (its package list: the device library's KINDS.md), pinned below, no
#                         package the image already has;
#   sglang-code.tar.xz    SGLang 0.5.23's and 0.5.6's Python code from $WSYNC_SGLANG_CACHE (scripts/install_sglang.sh
#                         puts it there): .py files, dist-info, the JIT kernel source folders whose presence they
#                         check at import, and the .complete stamps; no .pyc, no tuned-kernel JSON (~11 MB).
# About 35 MB in all. Checked on Python 3.12 with torch 2.11.0+cu130 and transformers 5.17.0 (the image's): both
# releases import, the CPU tier of tests/test_cuda_ipc.py passes, `pytest -m gpu` collects, `wsync bench` runs.
# Usage: bash scripts/pack_device.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.device}
CACHE="${WSYNC_SGLANG_CACHE:-$HOME/.cache/wsync/sglang}"
VERSIONS=(0.5.23 0.5.6)

WHEELS=(
    # the project: trainer (tensordict), protocol (pydantic), reference server (fastapi, uvicorn), delta (zstandard)
    zstandard==0.25.0 tensordict==0.15.3 pyvers==0.2.3 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.13.4
    pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 opentelemetry-api==1.45.2
    python-multipart==0.0.34 orjson==3.11.7
    # SGLang's receive code (module-level imports of 0.5.23 and 0.5.6)
    pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7 dill==0.4.1
    apache-tvm-ffi==0.1.15.post2 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0 xgrammar==0.2.9
    soundfile==0.14.0 cffi==2.0.0 pycparser==3.0 openai==3.60.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
    distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 interegular==0.3.3
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0
    # IPython (sglang.utils imports IPython.display) and its imports
    ipython==8.12.3 traitlets==5.15.0 decorator==5.2.1 jedi==0.20.0 parso==0.8.7 matplotlib-inline==0.2.2
    pexpect==4.8.0 ptyprocess==0.7.0 prompt_toolkit==3.0.52 wcwidth==0.7.0 stack_data==0.6.3 executing==2.2.1
    asttokens==3.0.1 pure_eval==0.2.3 ipython-pygments-lexers==1.1.1 pickleshare==0.7.5 backcall==0.2.0
)
PLATFORMS=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1 linux; do
    PLATFORMS+=(--platform "${p}_x86_64")
done

mkdir -p "$DIR/whl"
echo "== wheels into $DIR/whl"
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DIR/whl" "${WHEELS[@]}"
# One version of each: two stop the device's install.
dups=$(ls "$DIR/whl" | sed 's/-[0-9].*//' | tr 'A-Z_' 'a-z-' | sort | uniq -d)
[ -z "$dups" ] || { echo "pack_device.sh: several versions of: $dups (remove the stale wheels)" >&2; exit 1; }

echo "== SGLang ${VERSIONS[*]} code into $DIR/sglang-code.tar.xz"
for v in "${VERSIONS[@]}"; do
    [ -f "$CACHE/sglang-$v/.complete" ] || { echo "pack_device.sh: no $CACHE/sglang-$v (bash scripts/install_sglang.sh)" >&2; exit 1; }
done
(cd "$CACHE" && find "${VERSIONS[@]/#/sglang-}" -type f \( -name "*.py" -o -name "*.pyi" -o -name ".complete" \
    -o -path "*.dist-info/*" -o -path "*/jit/include/*" -o -path "*/jit/csrc/*" -o -path "*/jit_kernel/include/*" \
    -o -path "*/jit_kernel/csrc/*" \) ! -name "*.pyc" ! -path "*/__pycache__/*" | LC_ALL=C sort \
    | tar -cf - --owner=0 --group=0 -T - | xz -T0 -9) > "$DIR/sglang-code.tar.xz.tmp"
mv "$DIR/sglang-code.tar.xz.tmp" "$DIR/sglang-code.tar.xz"
du -sh "$DIR/whl" "$DIR/sglang-code.tar.xz"
du -sh "$DIR"
