"""Compare slipstream's tokenizer of a real GGUF with llama.cpp's and transformers' on fixed and
random texts. Not a test: the references are heavy (llama-cpp-python compiles llama.cpp;
transformers takes about a minute to load a 262k-token vocabulary), so this is run by hand:

    PYTHONPATH=src python tests/modelfile/check_tokenizer.py MODEL.gguf [--hf] [--random N]

llama.cpp (through llama-cpp-python, vocabulary only) is compared with special tokens parsed
and not; transformers (`--hf`) with BOS added and specials parsed, as it encodes by default.
It prints the agreement per reference and exits non-zero if any text differs.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.modelfile.tokenizer import Tokenizer

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "héllo wörld, café naïve",
         "你好，世界！今天天气很好。", "こんにちは世界", "مرحبا بالعالم", "Привет, мир!",
         "spaces    between     words", "tabs\t\tand\ttabs", "newlines\n\n\nand\r\nCRLF\n",
         "def f(x):\n    return x ** 2  # square\n\nprint(f(12))\n", "3.14159 and 1234567890",
         "emoji 😀 👍🏽 🎉", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
         "<|im_start|>user\nhi<|im_end|>", "don't I'll we've", "ALL CAPS and MiXeD cAsE",
         "trailing   ", "a\u00a0b\u2003c", "<table><tr><td>x</td></tr></table>", "ied 4 ½ months",
         *("\n" * n for n in (1, 2, 31, 32, 70)), *(" " * n for n in (1, 2, 31, 40))]
_POOL = ("abcdefghijklmnopqrstuvwxyz ABCXYZ 0123456789 .,;:!?'\"()[]{}<>/\\-_=+*&^%$#@~` "
         "éèêàçñüößøå ЖжЯяЩщ 中文字符 日本語 한국어 العربية עברית ελληνικά \t\n\r ½¾①Ⅻ "
         "😀🎉👍🏽🚀∑∫√≈≠ \u00a0\u2003\u200d\u0301 's 'll 'RE ")


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_POOL) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def _report(name: str, texts: list[str], ours: list[list[int]], ref: list[list[int]]) -> int:
    bad = [(t, a, b) for t, a, b in zip(texts, ours, ref) if a != b]
    print(f"{name}: {len(texts) - len(bad)}/{len(texts)} the same")
    for text, a, b in bad[:5]:
        print(f"  {text!r:.60}\n    ours {a[:16]}\n    ref  {b[:16]}")
    return len(bad)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--hf", action="store_true", help="also compare with transformers")
    ap.add_argument("--random", type=int, default=400, help="random texts besides the fixed ones")
    args = ap.parse_args()
    texts = TEXTS + random_texts(args.random)
    tok = Tokenizer.from_metadata(GGUFFile(args.model).metadata)
    differ = 0
    try:
        from llama_cpp import Llama  # optional and heavy: a compiled llama.cpp
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp comparison")
    else:
        ref = Llama(str(args.model), vocab_only=True, verbose=False)
        for special in (False, True):
            differ += _report(f"llama.cpp, special={special}", texts,
                              [tok.encode(t, add_special=False, parse_special=special)
                               for t in texts],
                              [ref.tokenize(t.encode(), add_bos=False, special=special)
                               for t in texts])
    if args.hf:
        from transformers import AutoTokenizer  # heavy, and only this comparison needs it

        hf = AutoTokenizer.from_pretrained(str(args.model.parent), gguf_file=args.model.name)
        differ += _report("transformers", texts, [tok.encode(t) for t in texts],
                          [hf.encode(t) for t in texts])
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
