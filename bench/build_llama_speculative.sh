#!/usr/bin/env bash
# Build llama.cpp's own speculative decoding tools (llama-speculative, llama-speculative-simple) from the llama.cpp
# that llama-cpp-python 0.3.36 vendors, so that bench/family_e2e.py --llama-speculative runs the same llama.cpp as
# its in-process llama.cpp rows. CPU only, static, into build/llama-speculative/ (git-ignored).
#
#   bash bench/build_llama_speculative.sh            # then: build/llama-speculative/cmake/bin/llama-speculative-simple
#   JOBS=2 NICE=19 bash bench/build_llama_speculative.sh
set -euo pipefail

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e  # PyPI's sdist of llama-cpp-python 0.3.36
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$ROOT/build/llama-speculative
JOBS=${JOBS:-2}
RUN=(nice -n "${NICE:-19}")
SDIST=$OUT/llama_cpp_python-$VERSION.tar.gz
SRC=$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp

mkdir -p "$OUT"
if [ ! -f "$SDIST" ]; then
    # the source distribution: the wheel installed here holds only the built libraries, not the tools' sources
    "${RUN[@]}" python -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$OUT"
fi
echo "$SHA256  $SDIST" | sha256sum -c -
[ -d "$SRC" ] || "${RUN[@]}" tar xzf "$SDIST" -C "$OUT"

# Examples on (the speculative tools live there); tests, server and other tools off; no HTTPS (GGUFs are local files).
# GGML_NATIVE (the default) as the pip build of the installed wheel: the host's own instruction set.
"${RUN[@]}" cmake -S "$SRC" -B "$OUT/cmake" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF
"${RUN[@]}" cmake --build "$OUT/cmake" -j "$JOBS" --target llama-speculative llama-speculative-simple
# llama.cpp puts its binaries in the build tree's bin/
ls -l "$OUT/cmake/bin/llama-speculative" "$OUT/cmake/bin/llama-speculative-simple"
