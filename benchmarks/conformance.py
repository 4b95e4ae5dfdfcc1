"""Conformance of slipstream against llama.cpp on the CPU, for each GGUF file given (several
quantizations of the default model):

1. tokenization: `Model.tokenize` against llama.cpp's `llama_tokenize` on varied strings
   (unicode, whitespace runs, code, numbers, emoji, special tokens), with and without
   special-token parsing; a small C++ helper's ids are cross-checked with `llama-tokenize`.
2. teacher-forced top-1: the corpus below (~2.6k tokens) in chunks of --ctx tokens, each in a
   fresh context, through llama.cpp (all logits, by the C++ helper) and `Model.logits(ids)`:
   the share of positions whose argmax agrees and the mean KL(llama.cpp || slipstream).
3. perplexity: `llama-perplexity -f corpus -c CTX` against `slipstream perplexity`.
4. speed (first model only): cpu.py's speed(), llama-bench against `slipstream bench`.

Thresholds: tokenization exactly equal; top-1 agreement >= 95%; |PPL difference| <= 1%.

Usage (llama.cpp's source at /tmp/llama.cpp, built CPU-only into its build/ with the targets
llama-tokenize, llama-perplexity, llama-bench and llama-quantize):

    python benchmarks/conformance.py --llama-src /tmp/llama.cpp \
        --make-quants Q8_0,Q6_K,Q5_K_M,Q5_0,Q4_K_M --quant-dir /tmp/quants \
        --llama-commit 0c1e57098 --out llamacpp-compare-cpu
    python benchmarks/conformance.py --llama-src /tmp/llama.cpp -m a.gguf -m b.gguf --no-bench

--make-quants requantizes the default model with `llama-quantize --allow-requantize`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

import common
from cpu import DEFAULT_MODEL, loadavg, slipstream_cli, speed  # noqa: F401  (shared)

REPO = common.ROOT

TOP1_MIN = 0.95
PPL_REL_MAX = 0.01

TOKENIZE_CASES = [
    "Hello world",
    " Hello world",
    "Hello, world! How are you today?",
    "",
    " ",
    "   leading and trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\n\nline five\r\nwindows line",
    "multiple     spaces      between     words",
    "\n\n\n",
    "The year 2024 had 366 days; 3.14159 is pi; 1,000,000 and 12345678901234567890.",
    "0x1F 0b1010 1e-9 -42 +7 100% $19.99 €5 ¥300",
    "Ünïcödé tëxt: naïve café, résumé, Zürich, São Paulo, Kraków.",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Русский текст и ελληνικά γράμματα.",
    "Arabic: مرحبا بالعالم — Hebrew: שלום עולם",
    "Emoji: 😀🚀🎉 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 👍🏽",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "<html><body><p class=\"x\">Hi &amp; bye</p></body></html>",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "snake_case camelCase PascalCase kebab-case SCREAMING_SNAKE",
    "It's don't we'll they're I'm you've she'd",
    "https://example.com/path?query=1&other=two#frag",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end<|endoftext|>",
    "<|im_start|><|im_end|><|im_start|>",
    "not special: <|im_start ... |im_end|> <| |>",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "!!!???...,,,;;;:::---___===+++***",
    "Mixed 123abc456 def789 x1y2z3",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
    "a\u0301 combining acute; ﬁ ligature; Ⅻ roman; ½ fraction",
]

CORPUS = r"""The Lighthouse Keeper's Ledger

The lighthouse at Carrow Point had been automated for eleven years before anyone thought to read the ledger that the last keeper left behind. It was a thick book bound in green cloth, its spine cracked in three places, and every page was ruled into the same columns: date, wind, visibility, vessels sighted, remarks. Most of the remarks were short. "Fog until noon." "Gull nest on the gallery rail again." "Replaced the lamp wick; the old one smoked." But toward the end of the book the remarks grew longer, and the handwriting grew smaller, as if the keeper had been trying to fit more of the world onto each line.

On the fourteenth of March he wrote: "A schooner passed close inshore at dusk, no lights showing. I signalled twice and had no answer. She rounded the point and was gone before I could fetch the glass. I have seen many ships here but never one that moved so quietly."

Two days later: "The schooner again, or her sister. This time I was ready. Three masts, a dark hull, and a figurehead I could not make out. The wind was from the north-east, force five, and she was running without a reef in her sails, which no sensible master would do in this weather. I logged her position as two cables south of the Mare's Teeth."

The remarks continue like this for nine more entries. The keeper never learned the schooner's name, and the harbour master at Dunleigh, to whom he wrote, replied only that no such vessel had been registered in the district. The last entry in the ledger is dated the second of April, and it reads, in full: "Clear skies. Visibility excellent. No vessels sighted. I think she has found whatever she was looking for."

How Tides Work

Tides are the regular rise and fall of sea level caused mainly by the gravitational pull of the Moon and, to a lesser degree, the Sun. Because gravity weakens with distance, the Moon pulls harder on the side of the Earth that faces it than on the Earth's centre, and harder on the centre than on the far side. The result is a stretching force that raises two bulges of water: one under the Moon and one on the opposite side of the planet. As the Earth rotates through these bulges, most coastlines experience two high tides and two low tides roughly every 24 hours and 50 minutes.

When the Sun, the Moon and the Earth line up, at new moon and full moon, their effects add together and produce spring tides, which have the largest range. When the Sun and Moon are at right angles, at the first and last quarters, their effects partly cancel and produce neap tides, with the smallest range. Local geography matters enormously: in a narrow funnel-shaped bay the tidal range can exceed fifteen metres, while some enclosed seas, such as the Mediterranean, see only a few centimetres.

A Conversation at the Station

"Excuse me, is this the platform for the 9:42 to Edinburgh?"
"It was, but they've moved it to platform six. There was an announcement a few minutes ago."
"Oh no. How far is platform six?"
"Just across the footbridge. You have about seven minutes, so you'll be fine if you don't stop for coffee."
"I was going to stop for coffee."
"Then you'll have to decide which matters more to you: the coffee or Edinburgh."
"Edinburgh, I suppose. Thank you!"
"Good luck. And mind the stairs; they're slippery when it rains."

Notes on Writing Clear Instructions

1. Say what the reader should do before you say why. People skim, and the first words of a sentence carry the most weight.
2. Use one step per sentence. If a step has a condition, put the condition first: "If the light is red, press reset."
3. Name things consistently. If you call it the "control panel" in step two, do not call it the "dashboard" in step five.
4. Give the expected result after each important step, so the reader knows whether it worked.
5. Test the instructions on someone who has never done the task. Watch where they hesitate; that is where the text is unclear.

Example: Computing a Moving Average

The following Python function computes a simple moving average over a list of numbers. It keeps a running sum so that each new value costs constant time, instead of re-adding the whole window.

def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result


if __name__ == "__main__":
    data = [3, 5, 7, 2, 8, 10, 11, 65, 72, 81, 99, 100, 150]
    print(moving_average(data, 3))

The same idea in C, using a fixed-size array and printing each average with two decimal places:

#include <stdio.h>

int main(void) {
    double data[] = {3, 5, 7, 2, 8, 10, 11, 65, 72, 81};
    int n = sizeof(data) / sizeof(data[0]);
    int window = 3;
    double total = 0.0;
    for (int i = 0; i < n; i++) {
        total += data[i];
        if (i >= window) total -= data[i - window];
        if (i >= window - 1) printf("%d: %.2f\n", i, total / window);
    }
    return 0;
}

A Short Table of Planetary Facts

Planet   | Mean radius (km) | Orbital period (days) | Moons
Mercury  | 2,439.7          | 88.0                  | 0
Venus    | 6,051.8          | 224.7                 | 0
Earth    | 6,371.0          | 365.26                | 1
Mars     | 3,389.5          | 687.0                 | 2
Jupiter  | 69,911           | 4,332.6               | 95
Saturn   | 58,232           | 10,759                | 146

Jupiter is more than twice as massive as all the other planets combined, and its Great Red Spot is a storm that has been observed for at least 190 years. Saturn's rings are made mostly of water ice, with particles ranging in size from grains of dust to chunks as large as a house. Mars has the tallest known volcano in the solar system, Olympus Mons, which rises about 22 kilometres above the surrounding plains, nearly three times the height of Mount Everest above sea level.

The Baker's Apprentice

Maria started at the bakery when she was sixteen, sweeping flour from the floor and carrying trays to the front of the shop. The baker, an old man named Tomas, did not talk much. He showed her things instead: how to feel when dough had been kneaded enough, how to tap the bottom of a loaf and listen for the hollow sound that meant it was done, how to shape a baguette with three folds and a roll. For the first month she ruined almost everything she touched. Her bread was dense, her croissants leaked butter, and once she forgot the salt entirely and had to watch the customers' faces as they tasted it.

"Mistakes are flour," Tomas told her one morning, as she threw away another tray. "You need a lot of it to make anything." She did not understand what he meant until much later, when she had her own shop and her own apprentice, and found herself saying the same words to a nervous boy who had just burned his first batch of rolls.

By the time she was twenty, Maria could run the ovens alone. She came in at four in the morning, when the streets were dark and quiet, and by seven the shelves were full: rye loaves with caraway seeds, braided challah, sourdough with a crackling crust, cinnamon buns glazed with sugar. Tomas would arrive at eight, look over the shelves without a word, and then nod once. That nod, she said years afterwards, was worth more to her than any prize.

Frequently Asked Questions

Q: How long does a typical battery last?
A: Under normal use, about 300 to 500 full charge cycles before its capacity falls below 80 percent of the original. Heat shortens this; keeping the device cool helps.

Q: Can I charge it overnight?
A: Yes. The charger stops drawing significant current once the battery is full, although keeping a battery at 100 percent for long periods does age it slightly faster than keeping it around 50 to 80 percent.

Q: What should I do if the device will not turn on?
A: Connect it to the charger for at least fifteen minutes, then hold the power button for ten seconds. If nothing happens, try a different cable and outlet before contacting support.

A Configuration File

# server settings
[server]
host = "127.0.0.1"
port = 8080
workers = 4
timeout_seconds = 30

[logging]
level = "info"
file = "/var/log/app/server.log"
rotate_mb = 50

[features]
enable_cache = true
cache_ttl = 3600
allowed_origins = ["https://example.org", "https://docs.example.org"]

Closing Thoughts

Every system, whether it is a lighthouse, a bakery, a tide table or a piece of software, depends on small routines done carefully and recorded honestly. The keeper's ledger is interesting not because of the mysterious schooner but because, for years before it appeared, he wrote down the wind and the visibility every single day. Without that patient record, the strange entries at the end would mean nothing at all. The same is true of measurements in science and of tests in engineering: the ordinary results are what give the unusual ones their meaning.

The second half of the ledger, which nobody had read until recently, also contains a list of repairs. In 1961 the keeper rebuilt the stairs to the lantern room, replacing forty-two oak treads, one at a time, over a single winter. In 1963 he repainted the tower, which took him the whole of July and used twenty-six gallons of white paint. In 1964 a storm broke three panes of the lantern glass, and he wrote that he sat up all night holding a tarpaulin over the gap so that the light would not go out. He did not complain about any of it. At the bottom of the page, in pencil, he added a single line: "A light that is kept is a light that is trusted."
"""


# ---------------------------------------------------------------------------------------------
# The C++ helper: libllama's own tokenizer and all-position logits, in fresh contexts.
LCDUMP_SRC = r"""
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
static std::vector<char> slurp(const char *p) {
    FILE *f = fopen(p, "rb"); if (!f) { perror(p); exit(1); }
    std::vector<char> v; char buf[1 << 16]; size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) v.insert(v.end(), buf, buf + n);
    fclose(f); return v;
}
// lcdump MODEL tok IN OUT PARSE_SPECIAL ADD_SPECIAL: IN = (u32 len, bytes)*, OUT = (i32 n, i32 ids[n])*
// lcdump MODEL logits IDS CTX OUT THREADS: IDS = i32*, OUT = f32 [chunks*CTX, n_vocab]
int main(int argc, char **argv) {
    if (argc < 5) { fprintf(stderr, "bad usage\n"); return 2; }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    auto mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    const llama_vocab *vocab = llama_model_get_vocab(model);
    std::string mode = argv[2];
    if (mode == "tok") {
        bool parse_special = argc > 5 ? atoi(argv[5]) : 1;
        bool add_special = argc > 6 ? atoi(argv[6]) : 1;
        auto in = slurp(argv[3]);
        FILE *out = fopen(argv[4], "wb");
        size_t off = 0;
        while (off + 4 <= in.size()) {
            uint32_t len; memcpy(&len, in.data() + off, 4); off += 4;
            std::vector<llama_token> toks(len + 16);
            int32_t n = llama_tokenize(vocab, in.data() + off, (int32_t)len, toks.data(),
                                       (int32_t)toks.size(), add_special, parse_special);
            if (n < 0) {
                toks.resize(-n);
                n = llama_tokenize(vocab, in.data() + off, (int32_t)len, toks.data(),
                                   (int32_t)toks.size(), add_special, parse_special);
            }
            off += len;
            fwrite(&n, 4, 1, out);
            if (n > 0) fwrite(toks.data(), 4, n, out);
        }
        fclose(out);
    } else if (mode == "logits") {
        auto raw = slurp(argv[3]);
        std::vector<llama_token> ids(raw.size() / 4);
        memcpy(ids.data(), raw.data(), ids.size() * 4);
        int ctxn = atoi(argv[4]);
        int threads = argc > 6 ? atoi(argv[6]) : 2;
        auto cp = llama_context_default_params();
        cp.n_ctx = ctxn; cp.n_batch = ctxn; cp.n_ubatch = ctxn; cp.n_seq_max = 1;
        cp.n_threads = threads; cp.n_threads_batch = threads;
        llama_context *ctx = llama_init_from_model(model, cp);
        if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }
        int nv = llama_vocab_n_tokens(vocab);
        FILE *out = fopen(argv[5], "wb");
        llama_batch b = llama_batch_init(ctxn, 0, 1);
        for (size_t s = 0; s + ctxn <= ids.size(); s += ctxn) {
            llama_memory_clear(llama_get_memory(ctx), true);
            b.n_tokens = ctxn;
            for (int i = 0; i < ctxn; i++) {
                b.token[i] = ids[s + i]; b.pos[i] = i; b.n_seq_id[i] = 1;
                b.seq_id[i][0] = 0; b.logits[i] = 1;
            }
            if (llama_decode(ctx, b)) { fprintf(stderr, "decode failed\n"); return 1; }
            for (int i = 0; i < ctxn; i++) fwrite(llama_get_logits_ith(ctx, i), 4, nv, out);
        }
        fclose(out);
        llama_batch_free(b);
        llama_free(ctx);
    }
    llama_model_free(model);
    return 0;
}
"""


def build_lcdump(src: Path, build: Path, work: Path) -> Path:
    exe = work / "lcdump"
    cpp = work / "lcdump.cpp"
    cpp.write_text(LCDUMP_SRC)
    libdir = build / "bin"
    cmd = ["g++", "-O2", "-std=c++17", str(cpp), "-o", str(exe),
           f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", f"-L{libdir}",
           "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{libdir}"]
    subprocess.run(cmd, check=True)
    return exe


def lc_tokenize(lcdump: Path, model: Path, texts: list[str], parse_special: bool,
                work: Path) -> list[list[int]]:
    inp, out = work / "tok_in.bin", work / "tok_out.bin"
    with open(inp, "wb") as f:
        for t in texts:
            b = t.encode("utf-8")
            f.write(struct.pack("<I", len(b)) + b)
    subprocess.run([str(lcdump), str(model), "tok", str(inp), str(out),
                    "1" if parse_special else "0", "1"], check=True)
    data = out.read_bytes()
    res, off = [], 0
    while off < len(data):
        (n,) = struct.unpack_from("<i", data, off)
        off += 4
        res.append(list(struct.unpack_from(f"<{n}i", data, off)) if n > 0 else [])
        off += 4 * max(n, 0)
    return res


def llama_tokenize_tool(build: Path, model: Path, text: str, parse_special: bool,
                        work: Path) -> list[int]:
    """The `llama-tokenize` tool itself (used to cross-check the helper)."""
    f = work / "tok_tool.txt"
    f.write_bytes(text.encode("utf-8"))
    cmd = [str(build / "bin/llama-tokenize"), "-m", str(model), "-f", str(f), "--ids",
           "--log-disable"]
    if not parse_special:
        cmd.append("--no-parse-special")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    m = re.findall(r"\[[\d, ]*\]", out)
    return json.loads(m[-1]) if m else []


def llama_commit(src: Path, given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except Exception:
        return "unknown"


def make_quants(build: Path, base: Path, types: list[str], outdir: Path) -> list[Path]:
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for t in types:
        p = outdir / f"SmolLM2-135M-Instruct.{t}.gguf"
        if not p.exists():
            subprocess.run([str(build / "bin/llama-quantize"), "--allow-requantize", str(base),
                            str(p), t, "2"], check=True, capture_output=True)
        paths.append(p)
    return paths


def tensor_types(path: Path) -> str:
    from slipstream.modelfile.gguf_file import GGUFFile
    gf = GGUFFile(path)
    counts: dict[str, int] = {}
    for t in gf.tensors.values():
        name = t.ggml_type.name
        counts[name] = counts.get(name, 0) + 1
    return ",".join(f"{k}x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def check_tokenization(lcdump, build, model_path, sl_model, work, cross_check: bool) -> dict:
    texts = TOKENIZE_CASES + [CORPUS]
    n_cases, n_equal, mismatches = 0, 0, []
    for parse_special in (True, False):
        ref = lc_tokenize(lcdump, model_path, texts, parse_special, work)
        for t, r in zip(texts, ref):
            s = sl_model.tokenize(t, add_special=True, parse_special=parse_special)
            n_cases += 1
            if s == r:
                n_equal += 1
            else:
                mismatches.append({"text": t[:80], "parse_special": parse_special,
                                   "llama": r[:40], "slipstream": s[:40]})
    tool_checked = tool_equal = 0
    if cross_check:  # the helper's ids against the llama-tokenize tool itself
        for parse_special in (True, False):
            ref = lc_tokenize(lcdump, model_path, TOKENIZE_CASES, parse_special, work)
            for t, r in zip(TOKENIZE_CASES, ref):
                if not t:
                    continue  # llama-tokenize refuses an empty prompt file
                tool = llama_tokenize_tool(build, model_path, t, parse_special, work)
                tool_checked += 1
                tool_equal += tool == r
    return {"cases": n_cases, "equal": n_equal, "mismatches": mismatches[:10],
            "tool_crosscheck": {"checked": tool_checked, "equal": tool_equal}}


def teacher_forced(lcdump, model_path, sl_model, ids, ctx, threads, work) -> dict:
    n_chunks = len(ids) // ctx
    used = ids[: n_chunks * ctx]
    idf, lf = work / "ids.bin", work / "logits.f32"
    idf.write_bytes(struct.pack(f"<{len(used)}i", *used))
    t0 = time.time()
    subprocess.run([str(lcdump), str(model_path), "logits", str(idf), str(ctx), str(lf),
                    str(threads)], check=True)
    t_lc = time.time() - t0
    nv = sl_model.config.vocab_size if hasattr(sl_model.config, "vocab_size") else None
    raw = np.memmap(lf, dtype=np.float32, mode="r")
    nv = raw.size // len(used) if nv is None else nv
    ref_all = raw.reshape(len(used), nv)
    agree = total = 0
    agree_scored = total_scored = 0
    kls, nll_lc, nll_sl = [], [], []
    t_sl = 0.0
    for c in range(n_chunks):
        chunk = used[c * ctx:(c + 1) * ctx]
        t0 = time.time()
        sl = sl_model.logits(chunk).float()
        t_sl += time.time() - t0
        ref = torch.from_numpy(np.array(ref_all[c * ctx:(c + 1) * ctx]))
        a_ref, a_sl = ref.argmax(-1), sl.argmax(-1)
        eq = (a_ref == a_sl)
        agree += int(eq.sum())
        total += ctx
        agree_scored += int(eq[ctx // 2:].sum())
        total_scored += ctx - ctx // 2
        lp_ref = torch.log_softmax(ref.double(), -1)
        lp_sl = torch.log_softmax(sl.double(), -1)
        kls.append((lp_ref.exp() * (lp_ref - lp_sl)).sum(-1))
        # the same scoring as perplexity: positions ctx/2 .. ctx-2 predict the next token
        tgt = torch.tensor(chunk[ctx // 2 + 1:])
        first = ctx // 2
        nll_lc.append(-lp_ref[first:ctx - 1].gather(1, tgt[:, None]).squeeze(1))
        nll_sl.append(-lp_sl[first:ctx - 1].gather(1, tgt[:, None]).squeeze(1))
    del raw
    lf.unlink()
    kl = torch.cat(kls)
    return {
        "tokens": len(used), "chunks": n_chunks, "ctx": ctx,
        "top1_agree": agree / total, "top1_agree_scored_half": agree_scored / total_scored,
        "kl_mean": float(kl.mean()), "kl_p99": float(kl.quantile(0.99)),
        "kl_max": float(kl.max()),
        "ppl_from_logits_llama": float(torch.cat(nll_lc).mean().exp()),
        "ppl_from_logits_slipstream": float(torch.cat(nll_sl).mean().exp()),
        "seconds_llama": round(t_lc, 2), "seconds_slipstream": round(t_sl, 2),
    }


def perplexity(build, model_path, corpus_file, ctx, threads) -> dict:
    out = subprocess.run([str(build / "bin/llama-perplexity"), "-m", str(model_path), "-f",
                          str(corpus_file), "-c", str(ctx), "-t", str(threads)],
                         check=True, capture_output=True, text=True)
    text = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", text)
    if not m:
        raise RuntimeError("llama-perplexity printed no final estimate:\n" + text[-2000:])
    lc, lc_err = float(m.group(1)), float(m.group(2))
    res = slipstream_cli(["perplexity", "-m", str(model_path), "-f", str(corpus_file),
                          "--ctx", str(ctx), "--device", "cpu"])
    m2 = re.search(r"perplexity ([\d.]+) over (\d+) tokens \((\d+) chunks", res.stdout + res.stderr)
    if not m2:
        raise RuntimeError("slipstream perplexity printed no result:\n" + res.stdout + res.stderr)
    sl = float(m2.group(1))
    return {"llama": lc, "llama_pm": lc_err, "slipstream": sl,
            "slipstream_scored_tokens": int(m2.group(2)), "slipstream_chunks": int(m2.group(3)),
            "rel_diff": (sl - lc) / lc}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-src", type=Path, required=True, help="llama.cpp source directory")
    ap.add_argument("--llama-build", type=Path, help="its build dir (default SRC/build)")
    ap.add_argument("--llama-commit", help="llama.cpp commit to record (default: git in SRC)")
    ap.add_argument("-m", "--model", type=Path, action="append", default=[],
                    help="GGUF file (repeatable); the default model is always included first")
    ap.add_argument("--make-quants", default="",
                    help="comma-separated llama-quantize types made from the default model")
    ap.add_argument("--quant-dir", type=Path, default=Path("/tmp/quants"))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.txt")
    ap.add_argument("--note", action="append", default=[],
                    help="a line recorded in the JSON and printed under the tables (repeatable)")
    ap.add_argument("--speed-only", action="store_true",
                    help="rerun only the speed comparison; keep the conformance results of an "
                         "existing OUT.json")
    args = ap.parse_args()
    build = args.llama_build or args.llama_src / "build"
    torch.set_num_threads(args.threads)

    import slipstream
    console = Console(record=True, width=140)
    work = Path(tempfile.mkdtemp(prefix="llamacpp_compare_"))
    lcdump = build_lcdump(args.llama_src, build, work)
    corpus_file = work / "corpus.txt"
    corpus_file.write_text(CORPUS, encoding="utf-8")

    models = [DEFAULT_MODEL] + args.model
    if args.make_quants and not args.speed_only:
        models += make_quants(build, DEFAULT_MODEL, args.make_quants.split(","), args.quant_dir)

    results = []
    old = None
    if args.speed_only:
        old = json.loads(Path(str(args.out) + ".json").read_text())
        results = old["results"]
        models = []
    for i, mp in enumerate(models):
        console.print(f"[bold]{mp.name}[/bold]  ({mp.stat().st_size / 1e6:.1f} MB)")
        sl_model = slipstream.load(mp, device="cpu", ctx=args.ctx)
        tok = check_tokenization(lcdump, build, mp, sl_model, work, cross_check=(i == 0))
        ids = lc_tokenize(lcdump, mp, [CORPUS], True, work)[0]
        tf = teacher_forced(lcdump, mp, sl_model, ids, args.ctx, args.threads, work)
        del sl_model
        ppl = perplexity(build, mp, corpus_file, args.ctx, args.threads)
        r = {"model": str(mp), "file": mp.name, "size_bytes": mp.stat().st_size,
             "tensor_types": tensor_types(mp), "tokenization": tok, "teacher_forced": tf,
             "perplexity": ppl}
        r["pass"] = {"tokenization": tok["equal"] == tok["cases"],
                     "top1": tf["top1_agree"] >= TOP1_MIN,
                     "ppl": abs(ppl["rel_diff"]) <= PPL_REL_MAX}
        results.append(r)
        console.print(f"  tok {tok['equal']}/{tok['cases']}  top1 {tf['top1_agree']:.4f}  "
                      f"KL {tf['kl_mean']:.5f}  ppl {ppl['llama']:.4f} vs {ppl['slipstream']:.4f}")

    spd = None
    if not args.no_bench:
        spd = speed(build, DEFAULT_MODEL, args.threads, args.reps, work)

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lcommit = llama_commit(args.llama_src, args.llama_commit)
    if old is not None:
        commit, lcommit = old["commit"], old["llama_cpp_commit"]
    t = Table(title=f"slipstream vs llama.cpp ({lcommit}), CPU, ctx {args.ctx}, "
                    f"slipstream {commit[:10]}, "
                    f"corpus {results[0]['teacher_forced']['tokens']} tokens")
    for col in ("file", "tensor types", "tokenize equal", "top-1 agree", "top-1 (2nd half)",
                "mean KL", "PPL llama.cpp", "PPL slipstream", "rel diff", "pass"):
        t.add_column(col, justify="left" if col in ("file", "tensor types") else "right",
                     overflow="fold")
    for r in results:
        tok, tf, ppl, ok = r["tokenization"], r["teacher_forced"], r["perplexity"], r["pass"]
        verdict = "yes" if all(ok.values()) else "NO: " + ",".join(k for k, v in ok.items() if not v)
        t.add_row(r["file"].replace("SmolLM2-135M-Instruct.", ""), r["tensor_types"],
                  f"{tok['equal']}/{tok['cases']}", f"{tf['top1_agree'] * 100:.2f}%",
                  f"{tf['top1_agree_scored_half'] * 100:.2f}%", f"{tf['kl_mean']:.5f}",
                  f"{ppl['llama']:.4f}", f"{ppl['slipstream']:.4f}",
                  f"{ppl['rel_diff'] * 100:+.3f}%", verdict)
    console.print(t)
    xc = results[0]["tokenization"]["tool_crosscheck"]
    console.print(f"helper tokenizer vs the llama-tokenize tool: {xc['equal']}/{xc['checked']} "
                  f"equal; thresholds: tokenization exact, top-1 >= {TOP1_MIN:.0%}, "
                  f"|PPL diff| <= {PPL_REL_MAX:.0%}")
    if spd:
        s = Table(title=f"speed, {DEFAULT_MODEL.name}, {spd['threads']} threads, "
                        f"load avg {spd['loadavg_before']} / {spd['loadavg_between']} / "
                        f"{spd['loadavg_after']}")
        for col in ("test", "llama.cpp tok/s", "slipstream tok/s", "slipstream / llama.cpp"):
            s.add_column(col, justify="right")
        for k in ("pp512", "tg128"):
            a, b = spd["llama"].get(k), spd["slipstream"].get(k)
            if a and b:
                s.add_row(k, f"{a['tok_s']:.1f} ± {a['tok_s_std']:.1f}",
                          f"{b['tok_s']:.1f} ± {b['tok_s_std']:.1f}",
                          f"{b['tok_s'] / a['tok_s']:.2f}x")
        console.print(s)

    for line in args.note:
        console.print(f"note: {line}")

    if args.out:
        doc = {"notes": args.note, "date": old["date"] if old else _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "speed_date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "commit": commit, "llama_cpp_commit": lcommit, "device": "cpu",
               "threads": args.threads, "ctx": args.ctx,
               "thresholds": {"top1_min": TOP1_MIN, "ppl_rel_max": PPL_REL_MAX,
                              "tokenization": "exact"},
               "results": results, "speed": spd,
               "all_pass": all(all(r["pass"].values()) for r in results)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        Path(str(args.out) + ".json").write_text(json.dumps(doc, indent=2) + "\n")
        Path(str(args.out) + ".txt").write_text(console.export_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
