#!/usr/bin/env bash
# llama.cpp's load time on the device, for the load comparison with `slipstream bench`: a small
# program against the libllama that llama_build (setup.sh) built, timing what a user waits for
# before the first token (llama-bench times no load): the model load at -ngl N, the context,
# and one decoded token, each in ms, REPS times in one process after one untimed load (so the
# file's pages are in the page cache, as for slipstream's warm runs).
#
#   bash benchmarks/device/llama_load.sh MODEL.gguf NGL [CTX] [REPS]
#
# LLAMA_BUILD (default /tmp/lbuild) is the build folder.
# Prints one JSON line: {"load_ms": [...], "context_ms": [...], "first_token_ms": [...], ...}.
set -euo pipefail
M=${1:?MODEL.gguf}; NGL=${2:?NGL}; CTX=${3:-4096}; REPS=${4:-3}
B=${LLAMA_BUILD:-/tmp/lbuild}; SRC=/tmp/llama-src/.llama
[ -d "$SRC" ] || SRC=.llama
LIB=$(dirname "$(find "$B" -name 'libllama.so*' | head -1)" 2>/dev/null)
[ -n "$LIB" ] && [ "$LIB" != . ] || { echo "no libllama under $B: run llama_build first" >&2; exit 1; }
EXE=/tmp/llama-load
if [ ! -x "$EXE" ]; then
  cat > /tmp/llama-load.cpp <<'CPP'
#include "llama.h"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
static double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
int main(int argc, char **argv) {
    const char *path = argv[1]; int ngl = atoi(argv[2]), ctxn = atoi(argv[3]), reps = atoi(argv[4]);
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    std::string load = "[", context = "[", first = "[";
    for (int r = -1; r < reps; r++) {  // r = -1: the untimed load that warms the page cache
        auto t0 = std::chrono::steady_clock::now();
        auto mp = llama_model_default_params(); mp.n_gpu_layers = ngl;
        llama_model *model = llama_model_load_from_file(path, mp);
        if (!model) { fprintf(stderr, "load failed\n"); return 1; }
        double t_load = ms_since(t0);
        auto cp = llama_context_default_params(); cp.n_ctx = ctxn; cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
        llama_context *ctx = llama_init_from_model(model, cp);
        if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }
        double t_ctx = ms_since(t0);
        llama_token tok = 1;
        if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
        llama_synchronize(ctx);
        double t_first = ms_since(t0);
        if (r >= 0) {
            const char *sep = r ? "," : "";
            load += sep + std::to_string(t_load); context += sep + std::to_string(t_ctx - t_load);
            first += sep + std::to_string(t_first - t_ctx);
        }
        llama_free(ctx); llama_model_free(model);
    }
    printf("{\"load_ms\": %s], \"context_ms\": %s], \"first_token_ms\": %s], \"ngl\": %d, \"ctx\": %d}\n",
           load.c_str(), context.c_str(), first.c_str(), ngl, ctxn);
    return 0;
}
CPP
  g++ -O2 -std=c++17 -I "$SRC/include" -I "$SRC/ggml/include" /tmp/llama-load.cpp -o "$EXE" \
    -L "$LIB" -lllama -lggml -lggml-base -Wl,-rpath,"$LIB"
fi
"$EXE" "$M" "$NGL" "$CTX" "$REPS"
