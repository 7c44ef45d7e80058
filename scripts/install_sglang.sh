#!/usr/bin/env bash
# Puts SGLang's own code on this machine, from PyPI only: for the `sglang_code` test tier (tests/test_sglang_*.py),
# and SGLang 0.5.23's whole server for the `real_sglang` tier (tests/test_real_sglang.py, `wsync sglang`).
#
# SGLang's kernel package has no CPU build; its server runs on CPU with the stand-ins of inference_adapter/sglang_cpu
# (test infrastructure: on GPU hosts SGLang runs as shipped), and its HTTP app and weight-update code of older
# releases import and run; tests/sglang_harness/ composes them into a receiving server. This script:
#   1. installs the pure-Python packages SGLang imports at module level into the current environment
#      (--no-deps each, so nothing replaces the project's torch/transformers pins);
#   2. unpacks each SGLang version with `pip install --no-deps --target $CACHE/sglang-<ver>`, side by side;
#      the harness runs each version in its own subprocess with that folder on PYTHONPATH;
#   3. checks that each version's weight-update modules import (with the stand-ins in tests/sglang_harness);
#   4. checks that SGLang 0.5.23's server imports on this host (`wsync sglang --check`).
# Idempotent: a version folder is complete once its `.complete` stamp exists; its import check is recorded in
# `.imports-ok` (a fingerprint of the harness's bootstrap/stand-ins and of torch, triton, transformers, fastapi and
# pydantic), so a second run re-checks only what changed.
#
# Releases (tests/sglang_harness/__init__.py, ALL_VERSIONS, is the list): 0.5.23, 0.5.6 and 0.4.9 carry the
# publishing tests (tests/test_sglang_code.py); the others pin each version gate of bridge/protocol.py from both
# sides, the release just before it and the first one at it (tests/test_sglang_versions.py):
#   weight_version      0.5.1   0.4.10.post2 | 0.5.1      (there is no 0.5.0 on PyPI)
#   destroy route       0.5.3   0.5.2        | 0.5.3
#   /server_info, load_format, pause mode    0.5.6: 0.5.5 | 0.5.6
#   paused update loses its version          0.5.6 only: 0.5.5 | 0.5.6 | 0.5.7
#   /get_weight_version 0.5.1-0.5.7: 0.5.7 | 0.5.8
#   sessions            0.5.21  0.5.20       | 0.5.21
#   flush fails the update instead of killing the scheduler  0.5.22: 0.5.21 | 0.5.22
# Every release tried imports on CPU with the stand-ins (0.4.x-0.5.1 need bootstrap.py's AMX-probe shim, 0.4.x its
# triton one too) and composes into the harness (0.4.10 and 0.5.20-0.5.22 through small version branches in
# tests/sglang_harness/serve.py); none was left out. 0.5.9, where the /get_weight_version and paused-version gates
# used to sit, pins nothing: running 0.5.7 and 0.5.8 put them at 0.5.8 and at 0.5.6 only.
#
# Usage: bash scripts/install_sglang.sh [VERSION ...]        (default: the versions the tier tests)
# Env:   WSYNC_SGLANG_CACHE (default ~/.cache/wsync/sglang)  -- the tests read the same variable.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${WSYNC_SGLANG_CACHE:-$HOME/.cache/wsync/sglang}"
VERSIONS=("$@")
if [ ${#VERSIONS[@]} -eq 0 ]; then
    read -r -a VERSIONS <<< "$(python -c 'from tests.sglang_harness import ALL_VERSIONS; print(*ALL_VERSIONS)')"
fi
PIP=(python -m pip install -q --disable-pip-version-check --no-deps)
t0=$(date +%s)

# Imported at module level by sglang.srt.entrypoints.http_server and the weight-update modules (0.4.9-0.5.23),
# or by those packages in turn. triton is imported (never run) by SGLang's layer code.
DEPS=(
    psutil pybase64 msgspec pyzmq uvloop setproctitle partial-json-parser python-multipart orjson
    aiohttp multidict yarl propcache aiohappyeyeballs aiosignal frozenlist attrs
    dill apache-tvm-ffi sentencepiece compressed-tensors loguru gguf einops xgrammar soundfile cffi
    openai distro jiter anyio sniffio httpx httpcore h11 certifi idna
    interegular IPython pillow scipy ninja triton
    # IPython's own imports (sglang.utils imports IPython.display): needed on a machine that lacks them.
    traitlets decorator jedi parso matplotlib-inline pexpect ptyprocess prompt_toolkit wcwidth pygments
    stack_data executing asttokens pure_eval ipython-pygments-lexers
    jsonschema jsonschema-specifications referencing rpds-py
)
MODS="psutil pybase64 msgspec zmq uvloop setproctitle partial_json_parser multipart orjson aiohttp dill tvm_ffi \
sentencepiece compressed_tensors loguru gguf einops xgrammar soundfile openai distro jiter anyio httpx IPython PIL \
scipy triton traitlets jsonschema"
if ! python -c "import importlib,sys; [importlib.import_module(m) for m in sys.argv[1:]]" $MODS >/dev/null 2>&1; then
    echo "== installing SGLang's pure-Python import dependencies"
    "${PIP[@]}" "${DEPS[@]}"
fi

mkdir -p "$CACHE"
for v in "${VERSIONS[@]}"; do
    dir="$CACHE/sglang-$v"
    if [ ! -f "$dir/.complete" ]; then
        echo "== unpacking sglang==$v into $dir"
        tmp="$CACHE/.tmp-sglang-$v-$$"
        rm -rf "$tmp"
        "${PIP[@]}" --target "$tmp" "sglang==$v"
        rm -rf "$tmp/bin" "$dir"
        touch "$tmp/.complete"
        mv "$tmp" "$dir"
    fi
done

echo "== checking that SGLang's weight-update code imports"
fp=$(python -m tests.sglang_harness.check_import --fingerprint)
for v in "${VERSIONS[@]}"; do
    dir="$CACHE/sglang-$v"
    if [ "$(cat "$dir/.imports-ok" 2>/dev/null)" = "$fp" ]; then
        echo "   sglang $v: imports ok (checked before, nothing changed since)"
        continue
    fi
    if ! out=$(python -m tests.sglang_harness.check_import "$dir" 2>&1); then
        rm -f "$dir/.imports-ok"
        echo "$out" | tail -20 >&2
        echo "install_sglang.sh: sglang==$v does not import; see above" >&2
        exit 1
    fi
    echo "$fp" > "$dir/.imports-ok"
    echo "   sglang $v: $(echo "$out" | tail -1)"
done
# Real SGLang's whole server on this host (the real_sglang tier, tests/test_real_sglang.py): SGLang 0.5.23 from its
# folder above, its Python dependencies (DEPS), the CPU stand-ins of inference_adapter/sglang_cpu, and this checkout
# on its PYTHONPATH (so --custom-weight-loader bridge.serving.sglang_delta_loader.load_delta resolves). `wsync sglang --check`
# imports what its processes import; recorded in `.server-ok` like the import checks above.
server="$CACHE/sglang-0.5.23"
if [ -f "$server/.complete" ]; then
    if [ "$(cat "$server/.server-ok" 2>/dev/null)" = "$fp" ]; then
        echo "   SGLang 0.5.23's server: imports ok (checked before, nothing changed since)"
    elif out=$(WSYNC_SGLANG_CACHE="$CACHE" python -m wsync sglang --check 2>&1); then
        echo "$fp" > "$server/.server-ok"
        echo "   $out"
    else
        rm -f "$server/.server-ok"
        echo "$out" | tail -20 >&2
        echo "install_sglang.sh: SGLang 0.5.23's server does not import on this host; see above" >&2
        exit 1
    fi
fi
echo "== SGLang code ready in $CACHE ($(( $(date +%s) - t0 )) s)"
