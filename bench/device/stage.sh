#!/usr/bin/env bash
# Stage a lent GPU host (Python 3.12, torch + CUDA, cmake, no package registry) over several
# back-to-back calls, each carrying what fits in one transfer:
#   - .devcarry/vllm-bundle/piece-NN (one per call; ../shared/tools/vllm-cuda-bundle/make.sh):
#     copied to /tmp/w; once all pieces and unpack.sh are there, vLLM is unpacked into /tmp/site;
#   - .devcarry/mini/*.whl (pip download --no-deps ... msgspec prometheus_client psutil safetensors
#     pytest pluggy iniconfig packaging pygments fastapi starlette uvicorn pydantic pydantic-core anyio
#     sniffio h11 click typing_extensions typing-inspection annotated-types idna highspy; fastapi<0.137:
#     0.165 imports opentelemetry, which the host lacks): installed into
#     /tmp/site once, only the packages the host's Python lacks;
#   - afore's C++ extensions: built once with cmake (bench/device/build_afore.sh), plus a dist-info
#     so that vLLM finds the plugin's entry point.
#   source bench/device/stage.sh      # then PYTHONPATH=/tmp/site:$PWD is exported
#
# A session's calls, back to back (the machine goes back 30 s after a call; ~2 min to start):
#   1. carry piece-00 + .devcarry/mini:  bash bench/device/ffn_e2e_cuda.sh       (no vLLM needed)
#   2. carry piece-01:                   bash bench/device/ab_gpu.sh             (no vLLM needed)
#   3. carry piece-02, unpack.sh, SHA256SUMS, BUNDLE_SHA256:  bash bench/device/gpu_tests.sh
#   4. carry .devcarry/bench-data:       bash bench/device/serve_cuda.sh
#   5.                                   bash bench/device/ffn_h200.sh
# (2026-12-02: calls 1-5 and two extra serve runs took 1,657 s of the 1,800 s budget.)
# Pieces survive only while the machine stays warm (it goes back 30 s after a call): carry the
# three pieces in three back-to-back calls of one machine session, or the unpack finds too few.
# 2026-12-02 (session 7): bench/device/pipeline.sh needs only .devcarry/mini (no vLLM); a serve run
# with FFN=1 CAPTURE=16 VARIANTS=shm DATASETS=gsm8k took 130-200 s including start-up.
# While helpers edit the working tree, run from a snapshot of HEAD instead (what session 6 did):
#   git archive HEAD -- . ':!bench/results' | tar -x -C .devcarry/head    # carry .devcarry/head too, and
#   R=$PWD; mkdir -p /tmp/afore && cp -r .devcarry/head/. /tmp/afore/ && cp -r bench/results /tmp/afore/bench/ \
#     && ln -sfn $R/.devcarry /tmp/afore/.devcarry && cd /tmp/afore && bash bench/device/<script>.sh
# (bench/results must come along: ab_gpu.sh calibrates from bench/results/migration.json). The
# scheduler part of h200.sh needs highspy's wheel in .devcarry/mini. serve_cuda.sh's servers took
# 459 s to come up on 2026-12-02 (graph capture through the FFN pool): give it a call of its own
# with VARIANTS of one or two servers.
mkdir -p /tmp/w /tmp/site
cp .devcarry/vllm-bundle/piece-* /tmp/w/ 2>/dev/null
if [ ! -f /tmp/site/.mini ] && ls .devcarry/mini/*.whl > /dev/null 2>&1; then
  need=""
  for whl in .devcarry/mini/*.whl; do
    mod=$(basename "$whl" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
    case "$mod" in pydantic_core) imp=pydantic_core ;; typing_extensions) imp=typing_extensions ;; *) imp=$mod ;; esac
    python3 -c "import $imp" 2>/dev/null || need="$need $whl"
  done
  [ -z "$need" ] || python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site $need 2>&1 | grep -v WARNING | tail -3
  touch /tmp/site/.mini
fi
# py-spy (serve_cuda.sh samples the first afore server with it) does not fit beside piece-00: carry
# .devcarry/spare (its wheel) with piece-01 or piece-02; unpacked here without pip's script handling
if [ ! -x /tmp/site/bin/py-spy ] && ls .devcarry/spare/py_spy-*.whl > /dev/null 2>&1; then
  mkdir -p /tmp/site/bin /tmp/pyspy && python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/pyspy')" \
    .devcarry/spare/py_spy-*.whl && cp /tmp/pyspy/py_spy-*.data/scripts/py-spy /tmp/site/bin/ && chmod +x /tmp/site/bin/py-spy \
    || echo "py-spy: could not unpack .devcarry/spare"
fi
if [ ! -d /tmp/site/vllm ] && [ -f .devcarry/vllm-bundle/unpack.sh ]; then
  n=$(ls /tmp/w/piece-* 2>/dev/null | wc -l)
  if [ "$n" -ge "$(wc -l < .devcarry/vllm-bundle/SHA256SUMS)" ]; then
    bash .devcarry/vllm-bundle/unpack.sh /tmp/w && rm -f /tmp/w/piece-*
  else
    echo "vLLM bundle: $n pieces in /tmp/w so far"
  fi
fi
export PYTHONPATH=/tmp/site:$PWD
source bench/device/build_afore.sh || return 1 2>/dev/null || exit 1
d=/tmp/site/afore-0.1.0.dist-info
if [ ! -d $d ]; then
  mkdir -p $d
  printf 'Metadata-Version: 2.1\nName: afore\nVersion: 0.1.0\n' > $d/METADATA
  printf '[vllm.general_plugins]\nafore = afore.attention.plugin:register\n\n[console_scripts]\nafore = afore.cli:main\n' > $d/entry_points.txt
fi
