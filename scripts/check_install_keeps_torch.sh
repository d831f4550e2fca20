#!/usr/bin/env bash
# `pip install -e .` into an environment that already has another torch keeps that torch.
# A metadata-only stand-in "torch 2.11.0" wheel is enough: pip's resolver reads only metadata,
# and the real GPU builds are several GB. Prints the torch version pip left installed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
. "$work/venv/bin/activate"
mkdir -p "$work/stub/torch" "$work/stub/torch-2.11.0.dist-info"
echo '__version__ = "2.11.0"' > "$work/stub/torch/__init__.py"
printf 'Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n' > "$work/stub/torch-2.11.0.dist-info/METADATA"
printf 'Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n' > "$work/stub/torch-2.11.0.dist-info/WHEEL"
( cd "$work/stub" && printf 'torch/__init__.py,,\ntorch-2.11.0.dist-info/METADATA,,\ntorch-2.11.0.dist-info/WHEEL,,\ntorch-2.11.0.dist-info/RECORD,,\n' > torch-2.11.0.dist-info/RECORD \
  && python3 -m zipfile -c "$work/torch-2.11.0-py3-none-any.whl" torch torch-2.11.0.dist-info )
pip install -q --no-index "$work/torch-2.11.0-py3-none-any.whl"
pip install -q -e "$root"
v="$(pip show torch | sed -n 's/^Version: //p')"
echo "torch after pip install -e .: $v"
[ "$v" = "2.11.0" ]
