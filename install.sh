#!/usr/bin/env bash
# Installs everything Kestrel needs on a fresh Debian/Ubuntu machine: Python packages (exact pins),
# and Chromium for the studio's browser tests. Safe to run again; it skips what is installed.
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq || true
  $SUDO apt-get install -y -qq chromium >/dev/null || echo "note: chromium not installed; browser tests will be skipped"
fi
# llama-cpp-python compiles llama.cpp from source (several minutes on 2 cores, once).
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} python3 -m pip install -q -r requirements.txt
# llama.cpp's vocabularies of real models (Llama 3, Qwen 2/3/3.5, Gemma 4, Phi-3, Mistral) with its
# tokenizer test strings, from llama-cpp-python's source distribution (pip's cache has it from the
# build above), and their Hugging Face conversions, for the tests; skipped once present.
python3 -m tests.support.real_vocab || echo "note: llama.cpp's vocabularies not fetched; the real-vocabulary tests will be skipped"
# Kestrel itself, editable, with the console scripts `kestrel` and `kestrel-studio`.
python3 -m pip install -q --no-deps --no-build-isolation -e .
