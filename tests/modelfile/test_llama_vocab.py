"""The tokenizer against llama.cpp's own vocabulary tests.

tests/data/llama-vocab/ holds llama.cpp's `models/ggml-vocab-*.gguf` files (GGUFs with only the
tokenizer metadata; xz-compressed, checked against SHA256SUMS of the originals) with the
`.gguf.inp` texts and `.gguf.out` token ids its tests/test-tokenizer-0.cpp checks; README.md
there says where they come from. Every text must encode to exactly llama.cpp's ids, as
test-tokenizer-0 asks: no BOS/EOS added, special tokens in the text left as text.
"""

from __future__ import annotations

import hashlib
import lzma
from pathlib import Path

import gguf
import numpy as np
import pytest

from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.modelfile.tokenizer import Tokenizer
from slipstream.modelfile.vocab import BYTE, CONTROL, NORMAL, USER_DEFINED

DATA = Path(__file__).resolve().parent.parent / "data" / "llama-vocab"
# test-tokenizer-0.cpp's marker between two inputs of a .inp file.
SEPARATOR = "\n__ggml_vocab_test__\n"
# Over 1.5 s each on a loaded 2-core machine (decompressing and building a 100k-262k token
# vocabulary: 1.8-7.4 s); the others take 0.4-1.1 s and stay in the fast tier.
SLOW = {"command-r", "deepseek-llm", "gemma-4", "llama-bpe", "qwen2", "qwen35"}


def _expected_sha256() -> dict[str, str]:
    sums = {}
    for line in (DATA / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        sums[name.removeprefix("ggml-vocab-").removesuffix(".gguf")] = digest
    return sums


SHA256 = _expected_sha256()


def read_cases(inp: Path, out: Path) -> dict[str, list[int]]:
    """The (text, ids) pairs of a .inp/.out pair, paired as test-tokenizer-0.cpp pairs them:
    inputs split at the marker (the file ends with one, which closes the last input), outputs
    one line of space-separated ids each, and a map from text to ids (a repeated text counts
    once)."""
    raw = inp.read_bytes().decode("utf-8")
    if raw.endswith(SEPARATOR):
        raw = raw[:-len(SEPARATOR)]
    texts = raw.split(SEPARATOR)
    lines = out.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # getline sees no line after the final newline
    assert len(texts) == len(lines), f"{inp.name}: {len(texts)} inputs, {len(lines)} outputs"
    return {text: [int(t) for t in line.split()] for text, line in zip(texts, lines)}


def _vocab_file(name: str, directory: Path) -> Path:
    data = lzma.decompress((DATA / f"ggml-vocab-{name}.gguf.xz").read_bytes())
    assert hashlib.sha256(data).hexdigest() == SHA256[name], f"{name}: not llama.cpp's file"
    path = directory / f"ggml-vocab-{name}.gguf"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else [])
                                  for n in sorted(SHA256)])
def test_encodes_as_llama_cpp(name: str, tmp_path: Path) -> None:
    gf = GGUFFile(_vocab_file(name, tmp_path))
    tok = Tokenizer.from_metadata(gf.metadata)
    cases = read_cases(DATA / f"ggml-vocab-{name}.gguf.inp", DATA / f"ggml-vocab-{name}.gguf.out")
    assert len(cases) >= 40
    failed = [(text, ids, tok.encode(text, add_special=False, parse_special=False))
              for text, ids in cases.items()
              if tok.encode(text, add_special=False, parse_special=False) != ids]
    assert not failed, (f"{name}: {len(cases) - len(failed)}/{len(cases)} as llama.cpp; first "
                        f"failures (text, llama.cpp, ours): {failed[:3]}")


def test_read_cases_pairs_inputs_with_lines(tmp_path: Path) -> None:
    # Empty inputs and outputs count: the first text below is "", whose ids are an empty line.
    inp, out = tmp_path / "v.inp", tmp_path / "v.out"
    inp.write_text(SEPARATOR + " a" + SEPARATOR + "b\n" + SEPARATOR, encoding="utf-8")
    out.write_text("\n 7 8\n9 10 11\n", encoding="utf-8")
    assert read_cases(inp, out) == {"": [], " a": [7, 8], "b\n": [9, 10, 11]}
    out.write_text("\n 7 8\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="3 inputs, 2 outputs"):
        read_cases(inp, out)


# -- the gemma4 tokenizer model on a vocabulary small enough to follow by hand ---------------------


def _tiny_gemma4(path: Path, add_bos: bool) -> Path:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    words = ["a", "b", "c", "▁", "ab", "▁ab", "\n", "\n\n", "é"]
    turns = ["<|channel>", "<|tool_response>", "<turn|>"]
    tokens = specials + byte_tokens + words + turns
    types = ([CONTROL] * 4 + [BYTE] * 256 + [NORMAL] * len(words)
             + [USER_DEFINED, USER_DEFINED, CONTROL])
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * len(tokens))
    # " ab" merges "a b" first, then "▁ ab"; "\n\n" from "\n \n".
    w.add_token_merges(["a b", "▁ ab", "\n \n"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(add_bos)
    w.add_add_space_prefix(False)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gemma4_spells_spaces_without_prefix_and_falls_back_to_bytes(tmp_path: Path) -> None:
    path = _tiny_gemma4(tmp_path / "g4.gguf", True)
    tokens = GGUFFile(path).metadata["tokenizer.ggml.tokens"]
    tok = Tokenizer.from_metadata(GGUFFile(path).metadata)
    pieces = lambda ids: [tok.token_to_piece(i) for i in ids]  # noqa: E731
    # No "▁" before the first word; each space is "▁"; "z" and "ü" are not in the vocabulary, so
    # they are their UTF-8 bytes as <0xXX> tokens; "é" is a token.
    ids = tok.encode("ab abz\n\nü é", add_special=False)
    assert pieces(ids) == ["ab", " ab", "z", "\n\n", "\ufffd", "\ufffd", " ", "é"]
    assert ids[2] == 4 + 0x7A and ids[4:6] == [4 + 0xC3, 4 + 0xBC]
    assert tok.decode(ids) == "ab abz\n\nü é"
    assert tok.encode("ab", add_special=True)[0] == 2
    # A user-defined token is matched whole even when special tokens are not parsed.
    assert pieces(tok.encode("a<|channel>b", add_special=False, parse_special=False)) == [
        "a", "<|channel>", "b"]
    # Generation stops at the end of a turn, at the EOS, and where the model awaits a tool.
    assert {tokens[i] for i in tok.eot_ids} == {"<eos>", "<turn|>", "<|tool_response>"}


def test_gemma4_adds_bos_whatever_the_file_says(tmp_path: Path) -> None:
    # llama.cpp overrides tokenizer.ggml.add_bos_token = false for Gemma 4.
    tok = Tokenizer.from_metadata(GGUFFile(_tiny_gemma4(tmp_path / "g4.gguf", False)).metadata)
    assert tok.add_bos and tok.encode("a") == [2, tok.encode("a", add_special=False)[0]]
