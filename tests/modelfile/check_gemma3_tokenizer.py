"""Compare the tokenizer of a real Gemma 3 GGUF (SentencePiece BPE, 262,144 tokens) with the
one transformers builds from the same file, on a few texts. Not a test: transformers takes
about a minute to load that vocabulary, so this is run by hand:

    PYTHONPATH=src python tests/modelfile/check_gemma3_tokenizer.py /path/to/gemma3.gguf

It prints one line per text and exits non-zero if any differs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.modelfile.tokenizer import Tokenizer

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "héllo wörld, café naïve",
         "你好，世界！今天天气很好。", "こんにちは世界", "مرحبا بالعالم", "Привет, мир!",
         "spaces    between     words", "tabs\t\tand\ttabs", "newlines\n\n\nand\r\nCRLF\n",
         "def f(x):\n    return x ** 2  # square\n\nprint(f(12))\n", "3.14159 and 1234567890",
         "emoji 😀 👍🏽 🎉", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
         "don't I'll we've", "ALL CAPS and MiXeD cAsE", "trailing   ", "a\u00a0b\u2003c",
         "<table><tr><td>x</td></tr></table>", "ied 4 ½ months"]


def main(path: Path) -> int:
    from transformers import AutoTokenizer  # heavy, and only this script needs it

    ours = Tokenizer.from_metadata(GGUFFile(path).metadata)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    differ = 0
    for text in TEXTS:
        a, b = ours.encode(text), hf.encode(text)
        same = a == b and ours.decode(a, skip_special=True) == hf.decode(a, skip_special_tokens=True)
        differ += not same
        print("same  " if same else "DIFFER", repr(text)[:60], "" if same else f"ours {a} hf {b}")
    print(f"{len(TEXTS) - differ}/{len(TEXTS)} the same")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
