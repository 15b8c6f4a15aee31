#!/usr/bin/env bash
# Build ik_llama.cpp (github.com/ikawrakow/ik_llama.cpp: ggml with iqk_mul_mat, the fastest CPU
# MoE GEMM/GEMV we compare with) CPU only, static, Release, for the side-by-side benchmarks
# (issue 23). Not part of CI; nothing from ik_llama.cpp is committed.
#
#   tools/build_ik_llama_cpp.sh [SRC]      # build (or reuse) ~/.cache/colibri/ik_llama.cpp/
#   tools/build_ik_llama_cpp.sh --print    # print the bin directory if a build is cached, else exit 1
#
# SRC: an ik_llama.cpp checkout, or a bare git repository (its HEAD is checked out with
# `git --work-tree DIR checkout HEAD -- .`: `git archive` leaves folders out). Without SRC the
# script clones GitHub's copy (needs the network).
# Result: $PREFIX/bin/{llama-bench,llama-cli} and $PREFIX/COMMIT.
# Env: COLIBRI_CACHE (default ~/.cache/colibri), JOBS (default 2), NICE (default 19).
set -euo pipefail

# The whole script is one function, parsed before it runs: editing this file mid-build
# cannot derail a running build.
main() {

  CACHE="${COLIBRI_CACHE:-$HOME/.cache/colibri}"
  PREFIX="$CACHE/ik_llama.cpp"
  JOBS="${JOBS:-2}"
  NICE="${NICE:-19}"
  TARGETS=(llama-bench llama-cli)
  URL="https://github.com/ikawrakow/ik_llama.cpp"

  if [[ "${CI:-}" == "true" ]]; then
    echo "build_ik_llama_cpp.sh: refusing to run under CI (it is a multi-minute native build)" >&2
    exit 2
  fi

  done_marker="$PREFIX/.complete"
  if [[ "${1:-}" == "--print" ]]; then
    [[ -f "$done_marker" ]] && { echo "$PREFIX/bin"; exit 0; }
    exit 1
  fi
  if [[ -f "$done_marker" ]]; then
    echo "ik_llama.cpp already built: $PREFIX/bin ($(cat "$PREFIX/COMMIT"))"
    exit 0
  fi

  for tool in cmake make cc c++ git; do
    command -v "$tool" >/dev/null || { echo "build_ik_llama_cpp.sh: '$tool' not found (apt-get install cmake build-essential git)" >&2; exit 1; }
  done

  work="$(mktemp -d "${TMPDIR:-/tmp}/ik-llama-build.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  src="$work/src"
  mkdir -p "$src"
  if [[ -z "${1:-}" ]]; then
    echo "cloning $URL"
    git clone --quiet --depth 1 "$URL" "$src"
  elif [[ "$(git -C "$1" rev-parse --is-bare-repository 2>/dev/null)" == "true" ]]; then
    echo "checking out $1 (bare) into $src"
    # a mirror may lack its largest blobs (web UI bundles, vocab GGUFs for tests): check out
    # the files whose blobs are there, and say which are not
    git --git-dir "$1" ls-tree -r HEAD | awk -F'\t' '{split($1, a, " "); print a[3] "\t" $2}' \
      >"$work/tree"
    cut -f1 "$work/tree" | git --git-dir "$1" cat-file --batch-check='%(objectname) %(objecttype)' \
      | paste - "$work/tree" | awk -F'\t' '$1 !~ / missing$/ {print $3}' >"$work/present"
    absent=$(( $(wc -l <"$work/tree") - $(wc -l <"$work/present") ))
    (( absent == 0 )) || echo "  $absent files absent from the mirror (not needed for the build)"
    git --git-dir "$1" --work-tree "$src" checkout HEAD --pathspec-from-file="$work/present"
    git --git-dir "$1" rev-parse HEAD >"$work/COMMIT"
  elif [[ -f "$1/CMakeLists.txt" ]]; then
    cp -r "$1/." "$src/"
  else
    echo "build_ik_llama_cpp.sh: $1 is neither an ik_llama.cpp checkout nor a bare repository" >&2
    exit 1
  fi
  [[ -f "$src/CMakeLists.txt" && -d "$src/ggml/src/iqk" ]] || {
    echo "build_ik_llama_cpp.sh: $src has no CMakeLists.txt or ggml/src/iqk: not ik_llama.cpp" >&2; exit 1; }
  [[ -f "$work/COMMIT" ]] || (git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown) >"$work/COMMIT"

  echo "configuring (CPU only, static, Release, native ISA)"
  nice -n "$NICE" cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >"$work/configure.log" 2>&1 \
    || { tail -40 "$work/configure.log" >&2; exit 1; }
  echo "building ${TARGETS[*]} with -j$JOBS (tens of minutes on 2 cores)"
  start=$(date +%s)
  nice -n "$NICE" cmake --build "$work/build" --config Release -j "$JOBS" --target "${TARGETS[@]}" \
    >"$work/build.log" 2>&1 || { tail -40 "$work/build.log" >&2; exit 1; }
  echo "built in $(( $(date +%s) - start )) s"

  # Install atomically: stage next to the destination, then rename.
  mkdir -p "$CACHE"
  stage="$(mktemp -d "$CACHE/.ik_llama.cpp.XXXXXX")"
  mkdir -p "$stage/bin"
  for t in "${TARGETS[@]}"; do cp "$work/build/bin/$t" "$stage/bin/"; done
  cp "$work/COMMIT" "$stage/COMMIT"
  date -u +%FT%TZ >"$stage/.complete"
  rm -rf "$PREFIX"
  mv "$stage" "$PREFIX"
  echo "ik_llama.cpp ready: $PREFIX/bin ($(cat "$PREFIX/COMMIT"))"
}

main "$@"
