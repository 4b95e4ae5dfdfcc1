"""The tokenizer a GGUF file describes, built on the Hugging Face `tokenizers` library.

A GGUF carries no `tokenizer.json`: it stores the vocabulary, merges, scores and token types under
llama.cpp's `tokenizer.ggml.*` keys. We turn those into a `tokenizers.Tokenizer` for encoding and
decode ourselves from per-token bytes, which makes streaming exact (see `StreamDecoder`).

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

import codecs
import re
from collections.abc import Iterable, Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers

from ..errors import TokenizerError

# tokenizer.ggml.token_type values (llama.cpp's LLAMA_TOKEN_TYPE_*, which are SentencePiece's).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Regexes of the pre-tokenizers, from the models' own tokenizer.json (as llama.cpp and HF's GGUF
# converter use them).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_LLAMA3_FAMILY = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                            "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"})
_SPLIT_REGEX = {
    **{name: _LLAMA3_SPLIT for name in _LLAMA3_FAMILY},
    **{name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez",
                                       "stablelm2", "hunyuan")},
    "qwen35": _QWEN35_SPLIT,
    **{name: _GPT4O_SPLIT for name in ("gpt-4o", "llama4", "kanana2", "minimax-m2")},
    "tekken": _TEKKEN_SPLIT,
}
# llama.cpp splits every digit off, then applies the GPT-2 regex, for these.
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                               "minerva-7b"})
# llama.cpp looks a whole pre-tokenized word up in the vocabulary before merging for these
# (Llama 3's tokenizer.json says `ignore_merges: true`); the result can differ from plain BPE.
_IGNORE_MERGES = _LLAMA3_FAMILY - {"dbrx", "smaug-bpe"} | {"tekken"}
# llama.cpp adds BOS for these unless `tokenizer.ggml.add_bos_token` says otherwise.
_ADD_BOS_BY_DEFAULT = _LLAMA3_FAMILY - {"dbrx", "smaug-bpe"} | {"tekken"}

# Token texts that end a turn in the chat formats we know (llama.cpp's EOG list, abridged).
_END_OF_TURN_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
})

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


def read_tokenizer_metadata(reader: Any) -> dict[str, Any]:
    """The `tokenizer.*` keys (and `general.architecture`) of a `gguf.GGUFReader` as plain values."""
    md: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.") or name == "general.architecture":
            md[name] = field.contents()
    return md


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


class Tokenizer:
    """Encode text to token ids and decode them back, as the GGUF's tokenizer does."""

    def __init__(self, *, backend: tokenizers.Tokenizer, model: str, pieces: list[bytes],
                 special_ids: frozenset[int], bos_id: int | None, eos_id: int | None,
                 add_bos: bool, add_eos: bool, strip_leading_space: bool,
                 eot_ids: frozenset[int]) -> None:
        self._backend = backend
        self._literal_backend: tokenizers.Tokenizer | None = None
        self.model = model
        self._pieces = pieces              # (vocab_size,) raw bytes each token decodes to
        self._special_ids = special_ids    # what decode(skip_special=True) drops
        self._bos_id, self._eos_id = bos_id, eos_id
        self._add_bos, self._add_eos = add_bos, add_eos
        self._strip_leading_space = strip_leading_space
        self._eot_ids = eot_ids

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_reader(cls, reader: Any) -> Tokenizer:
        return cls.from_metadata(read_tokenizer_metadata(reader))

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        _check_metadata(md)
        try:
            return cls._from_checked_metadata(md)
        except TokenizerError:
            raise
        except (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError):
            raise
        except BaseException as e:  # the tokenizers library (a Rust panic is a BaseException)
            raise TokenizerError(f"the tokenizer metadata (tokenizer.ggml.*) was rejected by the "
                                 f"tokenizers library: {type(e).__name__}: {_short(e)}; the "
                                 f"file's tokenizer is corrupt or of an unsupported kind") from None

    @classmethod
    def _from_checked_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        model = md.get("tokenizer.ggml.model")
        tokens = list(md["tokenizer.ggml.tokens"])
        types = list(md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        seen: dict[str, int] = {}
        clean = "" not in tokens and len(set(tokens)) == len(tokens)  # the loop has nothing to do
        for i, tok in enumerate(() if clean else tokens):
            if tok == "":
                tokens[i] = tok = f"[EMPTY_{i}]"   # llama.cpp's name for an empty token
            if tok in seen:
                raise TokenizerError(f"duplicate token in vocabulary: {tok!r} has ids "
                                     f"{seen[tok]} and {i}")
            seen[tok] = i

        pre = str(md.get("tokenizer.ggml.pre") or "")
        if model == "gpt2":
            backend, pieces = _byte_level_backend(md, tokens, types, pre)
            add_bos_default, strip = pre in _ADD_BOS_BY_DEFAULT, False
        elif model == "llama":
            add_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
            backend, pieces = _sentencepiece_backend(md, tokens, types, add_prefix)
            # Decoding drops the one space the prefix added, as HF's decoder does.
            add_bos_default, strip = True, add_prefix
        else:
            raise TokenizerError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                                 f"slipstream supports 'gpt2' and 'llama'")
        _add_special_tokens(backend, tokens, types)
        built = backend.get_vocab_size(with_added_tokens=True)
        if built != len(tokens):
            # An added token that missed its vocabulary entry would get a fresh id the model lacks.
            raise TokenizerError(f"tokenizer has {built} entries after building, expected {len(tokens)}")

        bos_id, eos_id = special_token_id(md, "bos"), special_token_id(md, "eos")
        add_bos = _add_flag(md, "bos", add_bos_default, bos_id)
        add_eos = _add_flag(md, "eos", False, eos_id)
        # Only tokens the file marks special count: a normal token spelled "<|im_end|>" is text.
        eot = {i for i, tok in enumerate(tokens)
               if tok in _END_OF_TURN_TEXTS and types[i] in (CONTROL, USER_DEFINED)}
        eot |= {i for i in (eos_id, special_token_id(md, "eot"), special_token_id(md, "eom"))
                if i is not None}
        # Like llama.cpp's token_to_piece(special=false), plus BOS/EOS as HF skips them too.
        special = {i for i, kind in enumerate(types) if kind in (CONTROL, UNKNOWN, UNUSED)}
        special |= {i for i in (bos_id, eos_id) if i is not None}
        return cls(backend=backend, model=model, pieces=pieces, special_ids=frozenset(special),
                   bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, add_eos=add_eos,
                   strip_leading_space=strip, eot_ids=frozenset(eot))

    # -- properties ---------------------------------------------------------------------------

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def eot_ids(self) -> frozenset[int]:
        """Ids that end a turn: EOS, the EOT/EOM ids from the file, and control tokens such as
        `<|im_end|>` or `<|eot_id|>` that the vocabulary has."""
        return self._eot_ids

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. `add_special` adds BOS/EOS as the file asks; `parse_special`
        matches control tokens like `<|im_start|>` in the text (user-defined tokens always match,
        as in llama.cpp)."""
        try:
            backend = self._backend if parse_special else self._literal()
            ids = backend.encode(text, add_special_tokens=False).ids
        except (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError):
            raise
        except BaseException as e:  # the tokenizers library (a Rust panic is a BaseException)
            raise TokenizerError(f"the tokenizer failed to encode the text: "
                                 f"{type(e).__name__}: {_short(e)}") from None
        if add_special:
            if self._add_bos and self._bos_id is not None:
                ids.insert(0, self._bos_id)
            if self._add_eos and self._eos_id is not None:
                ids.append(self._eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`. Invalid UTF-8 (e.g. half an emoji) becomes U+FFFD."""
        data = b"".join(self.token_to_bytes(i, skip_special) for i in ids)
        text = data.decode("utf-8", errors="replace")
        if self._strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def token_to_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The raw bytes token `token_id` stands for; may be part of a UTF-8 character."""
        token_id = int(token_id)  # numpy/torch scalars hash differently from int
        if not 0 <= token_id < len(self._pieces):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary "
                                 f"(size {len(self._pieces)})")
        if skip_special and token_id in self._special_ids:
            return b""
        return self._pieces[token_id]

    def token_to_piece(self, token_id: int) -> str:
        """The text of one token, special tokens included (U+FFFD for a partial character)."""
        return self.token_to_bytes(token_id).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        """Whether `decode(..., skip_special=True)` drops this token."""
        return int(token_id) in self._special_ids

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    def _literal(self) -> tokenizers.Tokenizer:
        # A twin that leaves special tokens in the text as text. `encode_special_tokens` is a
        # property of the whole tokenizer, so toggling it per call would race between threads.
        if self._literal_backend is None:
            twin = tokenizers.Tokenizer.from_str(self._backend.to_str())
            twin.encode_special_tokens = True
            self._literal_backend = twin
        return self._literal_backend


class StreamDecoder:
    """Turns ids into text one at a time, never emitting part of a UTF-8 character.

    Bytes of an incomplete character (an emoji split over byte-level tokens, or `<0xF0>` byte
    tokens) are held until the character completes; `flush()` releases whatever is left. The
    concatenation of everything `push` and `flush` return equals `tokenizer.decode(ids)`,
    because both decode the same byte string with the same UTF-8 error handling.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = True

    def push(self, token_id: int) -> str:
        data = self._tokenizer.token_to_bytes(token_id, self._skip_special)
        return self._emit(self._utf8.decode(data))

    def flush(self) -> str:
        text = self._emit(self._utf8.decode(b"", final=True))
        self._utf8.reset()
        self._at_start = True
        return text

    def _emit(self, text: str) -> str:
        if self._at_start and text:
            self._at_start = False
            if self._tokenizer._strip_leading_space and text.startswith(" "):
                text = text[1:]
        return text


# -- validation -------------------------------------------------------------------------------

_MAX_SCORE_MERGE_WORK = 2_000_000_000
_TOKEN_TYPES = range(0, 7)  # llama.cpp's LLAMA_TOKEN_TYPE_UNDEFINED .. BYTE
_TOKEN_TYPE_SET = frozenset(_TOKEN_TYPES)
# _check_metadata: the exact types each array's values may have without a closer look
_EXACT_TYPES = {"tokens": {str}, "merges": {str}, "token_type": {int}, "scores": {int, float}}


def _short(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _clip(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_metadata(md: Mapping[str, Any]) -> None:
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


# -- builders ---------------------------------------------------------------------------------


def _add_flag(md: Mapping[str, Any], which: str, default: bool, token_id: int | None) -> bool:
    key = f"tokenizer.ggml.add_{which}_token"
    if key not in md:
        return default and token_id is not None
    if md[key] and token_id is None:
        raise TokenizerError(f"{key} is true, but tokenizer.ggml.{which}_token_id is not set "
                             f"or out of range")
    return bool(md[key])


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


def _byte_level_backend(md: Mapping[str, Any], tokens: list[str], types: list[int],
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
                     ignore_merges=pre in _IGNORE_MERGES)
    backend = tokenizers.Tokenizer(bpe)
    if pre in _SPLIT_REGEX:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        # "gpt2", "gpt-2", "default", and anything we do not know: GPT-2's own regex.
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return backend, pieces


def _sentencepiece_backend(md: Mapping[str, Any], tokens: list[str], types: list[int],
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

    pieces = []
    for tok, kind in zip(tokens, types):
        if kind == BYTE and (m := _BYTE_TOKEN.fullmatch(tok)):
            pieces.append(bytes([int(m.group(1), 16)]))
        elif kind in (NORMAL, UNUSED):
            pieces.append(tok.replace("▁", " ").encode("utf-8"))
        else:
            pieces.append(tok.encode("utf-8"))
    return backend, pieces


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


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
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
