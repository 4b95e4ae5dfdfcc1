"""The tokenizer a GGUF file describes, built on the Hugging Face `tokenizers` library.

A GGUF carries no `tokenizer.json`: it stores the vocabulary, merges, scores and token types under
llama.cpp's `tokenizer.ggml.*` keys. vocab.py turns those into a `tokenizers.Tokenizer` for
encoding (following llama.cpp where it and the Hugging Face converter disagree); we decode
ourselves from per-token bytes, which makes streaming exact (see `StreamDecoder`).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping
from typing import Any

import tokenizers

from ..errors import TokenizerError
from .pretokenizers import ADD_BOS_BY_DEFAULT
from .vocab import (CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, add_special_tokens,
                    byte_level_backend, check_metadata, gemma4_backend, sentencepiece_backend,
                    special_token_id)

# Token texts that end a turn in the chat formats we know (llama.cpp's EOG list, abridged).
_END_OF_TURN_TEXTS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
    # Gemma 4: a turn ends with <turn|>; the model stops for a tool's answer at <|tool_response>.
    "<eos>", "<turn|>", "<|tool_response>",
})


def read_tokenizer_metadata(reader: Any) -> dict[str, Any]:
    """The `tokenizer.*` keys (and `general.architecture`) of a `gguf.GGUFReader` as plain values."""
    md: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.") or name == "general.architecture":
            md[name] = field.contents()
    return md


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
        check_metadata(md)
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
            backend, pieces = byte_level_backend(md, tokens, types, pre)
            add_bos_default, strip = pre in ADD_BOS_BY_DEFAULT, False
        elif model == "llama":
            add_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
            backend, pieces = sentencepiece_backend(md, tokens, types, add_prefix)
            # Decoding drops the one space the prefix added, as HF's decoder does.
            add_bos_default, strip = True, add_prefix
        elif model == "gemma4":
            backend, pieces = gemma4_backend(md, tokens, types)
            add_bos_default, strip = True, False
        else:
            raise TokenizerError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                                 f"slipstream supports 'gpt2', 'llama' and 'gemma4'")
        add_special_tokens(backend, tokens, types)
        built = backend.get_vocab_size(with_added_tokens=True)
        if built != len(tokens):
            # An added token that missed its vocabulary entry would get a fresh id the model lacks.
            raise TokenizerError(f"tokenizer has {built} entries after building, expected {len(tokens)}")

        bos_id, eos_id = special_token_id(md, "bos"), special_token_id(md, "eos")
        add_bos = _add_flag(md, "bos", add_bos_default, bos_id)
        if model == "gemma4":
            # llama.cpp adds BOS to Gemma 4 whatever the file says: its converter wrote
            # add_bos_token = false into early files, and the model needs the BOS.
            add_bos = bos_id is not None
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


# -- helpers ------------------------------------------------------------------------------------

def _short(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _add_flag(md: Mapping[str, Any], which: str, default: bool, token_id: int | None) -> bool:
    key = f"tokenizer.ggml.add_{which}_token"
    if key not in md:
        return default and token_id is not None
    if md[key] and token_id is None:
        raise TokenizerError(f"{key} is true, but tokenizer.ggml.{which}_token_id is not set "
                             f"or out of range")
    return bool(md[key])
