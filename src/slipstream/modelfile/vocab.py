"""A GGUF vocabulary as a Hugging Face `tokenizers` backend: llama.cpp's token types, GPT-2's
byte alphabet, the checks of the `tokenizer.ggml.*` values, and the three builders (byte-level BPE
for `gpt2`, its words cut as pretokenizers.py says; SentencePiece BPE with byte fallback for
`llama`; BPE over raw UTF-8 with ranked merges for `gemma4`). tokenizer.py makes the Tokenizer
from them.

Where llama.cpp and the Hugging Face GGUF converter disagree we follow llama.cpp, since GGUF
models are tuned and run there:

- SentencePiece vocabularies (`llama`) get the `▁` prefix on every text fragment, including one that
  starts with a space and one that follows a special token (HF prepends only at offset 0, and not
  at all when the text starts with a space). `tokenizer.ggml.add_space_prefix = false` is honoured.
- `llama-bpe` style vocabularies look a whole pre-tokenized word up before merging
  (`ignore_merges`, as in Llama 3's own tokenizer.json) and add BOS unless the file says not to.
- `smollm` style vocabularies split digits one by one before the GPT-2 regex, as llama.cpp does
  (HF's GGUF path uses the plain GPT-2 regex; SmolLM2's vocabulary has no token with two digits,
  so for it the two agree).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, models, normalizers

from ..errors import TokenizerError
from .pretokenizers import IGNORE_MERGES, byte_level_pre_tokenizer, newline_runs_pre_tokenizer

# tokenizer.ggml.token_type values (llama.cpp's LLAMA_TOKEN_TYPE_*, which are SentencePiece's).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            # Bytes that are whitespace or control characters move past U+00FF, in byte order.
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
# The same tables for whole strings at C speed (a vocabulary has 50-250k tokens, and a loop over
# their characters in Python took 0.2 s of each load): the first character outside the byte
# alphabet, and str.translate to the bytes' code points, which latin-1 then encodes as bytes.
_OUTSIDE_BYTE_ALPHABET = re.compile("[^" + "".join(map(re.escape, sorted(_CHAR_TO_BYTE))) + "]")
_ALPHABET_TO_LATIN1 = {ord(c): b for c, b in _CHAR_TO_BYTE.items()}


def special_token_id(md: Mapping[str, Any], name: str) -> int | None:
    """`tokenizer.ggml.<name>_token_id`, with llama.cpp's SentencePiece defaults; None if unset or
    outside the vocabulary (llama.cpp disables such ids rather than failing)."""
    defaults = {"bos": 1, "eos": 2, "unknown": 0} if md.get("tokenizer.ggml.model") == "llama" else {}
    key = f"tokenizer.ggml.{name}_token_id"
    value = md.get(key, defaults.get(name))
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TokenizerError(f"{key} is {value!r} ({type(value).__name__}), expected a token "
                             f"id; the file's tokenizer metadata is corrupt")
    tokens = md.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else 0
    if value is None or not 0 <= value < n_tokens:
        return None
    return value


# -- checks -------------------------------------------------------------------------------------

_MAX_SCORE_MERGE_WORK = 2_000_000_000
_TOKEN_TYPES = range(0, 7)  # llama.cpp's LLAMA_TOKEN_TYPE_UNDEFINED .. BYTE
_TOKEN_TYPE_SET = frozenset(_TOKEN_TYPES)
# check_metadata: the exact types each array's values may have without a closer look
_EXACT_TYPES = {"tokens": {str}, "merges": {str}, "token_type": {int}, "scores": {int, float}}


def _clip(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_metadata(md: Mapping[str, Any]) -> None:
    """The tokenizer.ggml.* values have the types and lengths the builders assume; a failure
    names the key, the entry and the value."""
    model = md.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError("GGUF has no tokenizer.ggml.model; cannot build a tokenizer")
    if not isinstance(model, str):
        raise TokenizerError(f"tokenizer.ggml.model is {_clip(model)}, expected a string such "
                             f"as 'gpt2' or 'llama'; the file's tokenizer metadata is corrupt")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError("GGUF has no tokenizer.ggml.tokens; cannot build a tokenizer")
    if not isinstance(tokens, list):
        raise TokenizerError(f"tokenizer.ggml.tokens is {_clip(tokens)}, expected an array of "
                             f"strings; the file's tokenizer metadata is corrupt")
    n = len(tokens)
    for name, kind in (("tokens", str), ("merges", str), ("token_type", int),
                       ("scores", (int, float))):
        values = md.get(f"tokenizer.ggml.{name}")
        if values is None:
            continue
        if not isinstance(values, list):
            raise TokenizerError(f"tokenizer.ggml.{name} is {_clip(values)}, expected an array; "
                                 f"the file's tokenizer metadata is corrupt")
        # the types present, gathered at C speed; only an unexpected one needs the loop below,
        # which finds the first offender (and accepts subclasses, as isinstance does)
        exact = set(map(type, values)) <= _EXACT_TYPES[name]
        for i, v in enumerate(() if exact else values):
            if isinstance(v, bool) or not isinstance(v, kind):
                raise TokenizerError(f"tokenizer.ggml.{name}[{i}] is {_clip(v)} "
                                     f"({type(v).__name__}); the file's tokenizer metadata is "
                                     f"corrupt")
        if name in ("token_type", "scores") and values and len(values) != n:
            raise TokenizerError(f"tokenizer.ggml.{name} has {len(values)} entries for {n} "
                                 f"tokens; the file's tokenizer metadata is corrupt")
    token_types = md.get("tokenizer.ggml.token_type") or ()
    for i, t in enumerate(() if set(token_types) <= _TOKEN_TYPE_SET else token_types):
        if t not in _TOKEN_TYPES:
            raise TokenizerError(f"tokenizer.ggml.token_type[{i}] is {t}, not a token type "
                                 f"(0..6); the file's tokenizer metadata is corrupt")
    for name in ("bos", "eos", "unknown", "padding", "eot", "eom"):
        special_token_id(md, name)  # type errors raise here


# -- builders -----------------------------------------------------------------------------------

def _parse_merges(merges: Iterable[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        # Split at the first space after position 0, as llama.cpp does, so a merge whose left
        # side is itself a space still parses.
        cut = merge.find(" ", 1) if isinstance(merge, str) else -1
        if cut < 0 or cut == len(merge) - 1:
            raise TokenizerError(f"malformed merge {_clip(merge)} in tokenizer.ggml.merges "
                                 f"(expected two tokens separated by a space); the file's "
                                 f"tokenizer is corrupt")
        pairs.append((merge[:cut], merge[cut + 1:]))
    return pairs


def _check_merges(pairs: list[tuple[str, str]], vocab: Mapping[str, int]) -> None:
    """Every merge joins two tokens into a third, all in the vocabulary (the tokenizers library
    refuses anything else, with a message that does not say which merge)."""
    for i, (a, b) in enumerate(pairs):
        for part in (a, b, a + b):
            if part not in vocab:
                raise TokenizerError(
                    f"tokenizer.ggml.merges[{i}] {_clip(a + ' ' + b)} uses {_clip(part)}, "
                    f"which is not in tokenizer.ggml.tokens; the file's tokenizer is corrupt")


def byte_level_backend(md: Mapping[str, Any], tokens: list[str], types: list[int],
                        pre: str) -> tuple[tokenizers.Tokenizer, list[bytes]]:
    """GPT-2 style byte-level BPE; `pre` picks the regex that splits text into words."""
    if "tokenizer.ggml.merges" not in md:
        raise TokenizerError("gpt2 tokenizer has no tokenizer.ggml.merges")
    vocab: dict[str, int] = {}
    pieces: list[bytes] = []
    spelled = set(tokens)
    outside = _OUTSIDE_BYTE_ALPHABET.search
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        in_alphabet = outside(tok) is None
        if kind in (NORMAL, UNUSED) and in_alphabet:
            pieces.append(tok.translate(_ALPHABET_TO_LATIN1).encode("latin-1"))
        elif kind == BYTE and (m := _BYTE_TOKEN.fullmatch(tok)):
            pieces.append(bytes([int(m.group(1), 16)]))
        else:
            # Special tokens, and normal ones spelled outside the byte alphabet, are their text.
            pieces.append(tok.encode("utf-8"))
        key = tok
        if kind == NORMAL and not in_alphabet:
            # Respell a token written in plain text into the byte alphabet so merges can reach
            # it, as HF's converter does -- unless that spelling is already taken.
            respelled = "".join(_BYTE_TO_CHAR[b] for b in tok.encode("utf-8"))
            key = tok if respelled in spelled or respelled in vocab else respelled
        vocab[key] = i

    merges = _parse_merges(md["tokenizer.ggml.merges"])
    _check_merges(merges, vocab)
    bpe = models.BPE(vocab=vocab, merges=merges, dropout=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                     ignore_merges=pre in IGNORE_MERGES)
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = byte_level_pre_tokenizer(pre)
    return backend, pieces


def sentencepiece_backend(md: Mapping[str, Any], tokens: list[str], types: list[int],
                           add_prefix: bool) -> tuple[tokenizers.Tokenizer, list[bytes]]:
    """SentencePiece BPE with byte fallback, spaces spelled `▁`."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if "tokenizer.ggml.merges" in md:
        merges = _parse_merges(md["tokenizer.ggml.merges"])
        _check_merges(merges, vocab)
    elif "tokenizer.ggml.scores" in md:
        merges = merges_from_scores(tokens, [float(s) for s in md["tokenizer.ggml.scores"]])
    else:
        raise TokenizerError("llama tokenizer has neither tokenizer.ggml.merges nor "
                             "tokenizer.ggml.scores")
    unk_id = special_token_id(md, "unknown")
    bpe = models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=True, byte_fallback=True,
                     unk_token=tokens[unk_id] if unk_id is not None else None)
    backend = tokenizers.Tokenizer(bpe)
    # A normalizer, not Metaspace: it runs on every fragment between added tokens, so each one gets
    # the prefix even when it starts with a space or follows a special token, as in llama.cpp.
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None

    return backend, spm_pieces(tokens, types)


def spm_pieces(tokens: list[str], types: list[int]) -> list[bytes]:
    """The bytes each token of a vocabulary spelled with `▁` and `<0xXX>` stands for."""
    pieces = []
    for tok, kind in zip(tokens, types):
        if kind == BYTE and (m := _BYTE_TOKEN.fullmatch(tok)):
            pieces.append(bytes([int(m.group(1), 16)]))
        elif kind in (NORMAL, UNUSED):
            pieces.append(tok.replace("▁", " ").encode("utf-8"))
        else:
            pieces.append(tok.encode("utf-8"))
    return pieces



def gemma4_backend(md: Mapping[str, Any], tokens: list[str],
                   types: list[int]) -> tuple[tokenizers.Tokenizer, list[bytes]]:
    """Gemma 4's tokenizer (`tokenizer.ggml.model = gemma4`): BPE with ranked merges over raw
    UTF-8, spaces spelled `▁` but no `▁` prefix, `<0xXX>` byte tokens for what the vocabulary
    lacks, and no split but lines and newline runs (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4).

    llama.cpp also takes a run of newlines whole when the vocabulary has it (Gemma 4 has runs of
    1 to 31). Plain BPE builds the same: the merges rank the longer runs first, so a run of up to
    31 newlines merges into one token and a longer one into 31s and the rest, as llama.cpp's own
    BPE does for it. `ignore_merges` (look every word up whole) would not do: 6302 of the
    vocabulary's tokens (`<table>`, `<unused0>`, ...) are not what BPE builds from their text,
    and llama.cpp, like plain BPE, spells a line `<table>` as `<`, `table`, `>`.
    """
    if "tokenizer.ggml.merges" not in md:
        raise TokenizerError("gemma4 tokenizer has no tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = _parse_merges(md["tokenizer.ggml.merges"])
    _check_merges(merges, vocab)
    unk_id = special_token_id(md, "unknown")
    bpe = models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False, byte_fallback=True,
                     unk_token=tokens[unk_id] if unk_id is not None else None)
    backend = tokenizers.Tokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = newline_runs_pre_tokenizer()
    return backend, spm_pieces(tokens, types)


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best score first. This is HF's `generate_merges`, so ties break the same way."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # Each token of length L tries L splits of O(L) each: bound the work a hostile vocabulary
    # of long tokens can ask for (real ones need a few million).
    work = sum(len(t) ** 2 for t in tokens)
    if work > _MAX_SCORE_MERGE_WORK:
        longest = max(tokens, key=len)
        raise TokenizerError(f"tokenizer.ggml.tokens holds tokens too long to derive merges from "
                             f"tokenizer.ggml.scores (the longest has {len(longest)} characters); "
                             f"the file's tokenizer is corrupt")
    by_score = dict(zip(tokens, scores))
    merges: list[tuple[str, str, float]] = []
    for piece, score in by_score.items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Register control/unknown tokens as special and user-defined ones as plain added tokens, so
    they are matched whole in the text. `normalized=False` matches them before the normalizer
    (and before the `▁` prefix) runs."""
    special = [AddedToken(tok, special=True, normalized=False)
               for tok, kind in zip(tokens, types) if kind in (CONTROL, UNKNOWN)]
    user = [AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(tokens, types) if kind == USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
