#!/usr/bin/env bash
# Build llama.cpp (CPU only, static, Release) from the llama-cpp-python sdist on PyPI, for the
# side-by-side benchmarks (issue 8). Not part of CI; nothing from llama.cpp is committed.
#
#   tools/build_llama_cpp.sh            # build (or reuse) ~/.cache/colibri/llama.cpp-<version>/
#   tools/build_llama_cpp.sh --print    # print the bin directory if a build is cached, else exit 1
#
# Result: $PREFIX/bin/{llama-bench,llama-completion,llama-quantize,llama-debug,llama-perplexity,
# llama-server}
# (llama-perplexity: the quality section's PPL beside colibri eval's; llama-debug
# --save-logits writes the last token's logits, used by the same-weights check), and
# $PREFIX/src (the vendored llama.cpp tree, with its convert_hf_to_gguf.py and gguf-py).
# ggml's AMX path is compiled out (-mno-amx-*): on AMX machines (Sapphire Rapids and later) its
# ggml_backend_amx_mul_mat segfaults in llama-bench and llama-debug at the first matmul
# (ggml-org/llama.cpp#20824, open, unfixed; seen here on this repo's bench GGUFs), and it serves
# only MUL_MAT, not the experts' MUL_MAT_ID, so without it llama.cpp runs its AVX-512 VNNI and
# repack kernels. $PREFIX/BUILD_FLAGS records this; a build without that record is rebuilt.
# Env: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), COLIBRI_CACHE (default ~/.cache/colibri),
#      JOBS (default 2), NICE (default 19), PYTHON (default the repo's .venv/bin/python).
set -euo pipefail

# The whole script is one function, parsed before it runs: editing this file mid-build
# cannot derail a running build.
main() {

  VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
  CACHE="${COLIBRI_CACHE:-$HOME/.cache/colibri}"
  PREFIX="$CACHE/llama.cpp-$VERSION"
  JOBS="${JOBS:-2}"
  NICE="${NICE:-19}"
  TARGETS=(llama-bench llama-completion llama-quantize llama-debug llama-perplexity llama-server)
  REPO="$(cd "$(dirname "$0")/.." && pwd)"
  PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
  [[ -x "$PYTHON" ]] || PYTHON=python3

  if [[ "${CI:-}" == "true" ]]; then
    echo "build_llama_cpp.sh: refusing to run under CI (it is a multi-minute native build)" >&2
    exit 2
  fi

  done_marker="$PREFIX/.complete"
  if [[ "${1:-}" == "--print" ]]; then
    [[ -f "$done_marker" ]] && { echo "$PREFIX/bin"; exit 0; }
    exit 1
  fi
  if [[ -f "$done_marker" ]]; then
    missing=()
    for t in "${TARGETS[@]}"; do [[ -x "$PREFIX/bin/$t" ]] || missing+=("$t"); done
    if (( ${#missing[@]} == 0 )) && [[ -f "$PREFIX/BUILD_FLAGS" ]]; then
      echo "llama.cpp $VERSION already built: $PREFIX/bin"
      exit 0
    fi
    # a build from before a target was added (e.g. llama-perplexity), or with ggml's AMX path
    if (( ${#missing[@]} )); then
      echo "llama.cpp $VERSION is built but lacks ${missing[*]}: rebuilding"
    else
      echo "llama.cpp $VERSION was built with ggml's AMX path (it crashes, llama.cpp#20824): rebuilding"
    fi
  fi

  for tool in cmake make cc c++; do
    command -v "$tool" >/dev/null || { echo "build_llama_cpp.sh: '$tool' not found (apt-get install cmake build-essential)" >&2; exit 1; }
  done

  work="$(mktemp -d "${TMPDIR:-/tmp}/llama-build.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  cd "$work"
  echo "fetching llama-cpp-python==$VERSION sdist"
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$work" \
    "llama-cpp-python==$VERSION"
  tar xzf llama_cpp_python-"$VERSION".tar.gz
  src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
  [[ -f "$src/CMakeLists.txt" ]] || { echo "no vendor/llama.cpp in the sdist" >&2; exit 1; }

  # -march=native minus AMX (see the top): where the compiler knows the flags
  noamx=""
  if echo 'int main(void){return 0;}' | cc -x c -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -o /dev/null - 2>/dev/null; then
    noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  fi
  echo "configuring (CPU only, static, Release, native ISA${noamx:+ without AMX})"
  nice -n "$NICE" cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF >"$work/configure.log"
  echo "building ${TARGETS[*]} with -j$JOBS (several minutes)"
  start=$(date +%s)
  nice -n "$NICE" cmake --build "$work/build" --config Release -j "$JOBS" --target "${TARGETS[@]}" \
    >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; exit 1; }
  echo "built in $(( $(date +%s) - start )) s"

  # Install atomically: stage next to the destination, then rename.
  mkdir -p "$CACHE"
  stage="$(mktemp -d "$CACHE/.llama.cpp-$VERSION.XXXXXX")"
  mkdir -p "$stage/bin"
  for t in "${TARGETS[@]}"; do cp "$work/build/bin/$t" "$stage/bin/"; done
  cp -r "$src" "$stage/src"
  "$stage/bin/llama-bench" --help >/dev/null 2>&1 || true
  (cd "$src" && git describe --tags 2>/dev/null || true) >"$stage/LLAMA_CPP_COMMIT"
  echo "GGML_NATIVE=ON ${noamx:-(compiler has no -mno-amx flags)}" >"$stage/BUILD_FLAGS"
  echo "$VERSION" >"$stage/.complete"
  rm -rf "$PREFIX"
  mv "$stage" "$PREFIX"
  echo "llama.cpp $VERSION ready: $PREFIX/bin"
}

main "$@"
