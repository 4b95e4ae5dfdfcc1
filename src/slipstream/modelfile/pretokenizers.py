"""How byte-level (`gpt2`) vocabularies cut text into words before BPE, keyed by
`tokenizer.ggml.pre`, as llama.cpp's src/llama-vocab.cpp does.

llama.cpp applies a list of regexes in turn: each one splits every piece the previous ones left
into its matches and the text between them (the `tokenizers` library's `Split(..., "isolated")`).
The regexes here are the models' own (from their tokenizer.json, as llama.cpp quotes them);
llama.cpp rewrites a few of them for `std::regex` (`(?i:'s)` as `'[sS]`), which the Oniguruma
engine of `tokenizers` does not need. llama.cpp's vocabulary tests (`ggml-vocab-*.gguf` with
their `.inp`/`.out` token ids) pass whole with these; tests/modelfile/test_llama_vocab.py runs them.
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
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
# The CJK ranges DeepSeek's tokenizers isolate: CJK ideographs U+4E00-U+9FA5, U+0800-U+4E00
# (Samaritan to CJK, which takes in kana), Hangul syllables U+AC00-U+D7FF.
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek LLM's letters: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee and other cased
# scripts, as ranges from its tokenizer.json (the list llama.cpp carries), written as escapes
# because several are canonically equivalent to other characters and an editor's normalisation
# would empty a range (U+1FD0-U+1FD3 would become U+1FD0-U+0390).
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
# ASCII and full-width punctuation, curly quotes, the ideographic space, comma and full stop.
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"

_LLAMA3_FAMILY = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                            "midm-2.0", "lfm2", "jina-v5-nano"})
# GLM-4's tokenizer.json has Llama 3's regex (llama.cpp: LLAMA_VOCAB_PRE_TYPE_CHATGLM4).
_GLM4 = frozenset({"glm4", "glm5", "chatglm-bpe"})

# tokenizer.ggml.pre -> the regexes llama.cpp applies in turn. A name not here gets GPT-2's.
SPLITS: dict[str, tuple[str, ...]] = {
    **{name: (_LLAMA3_SPLIT,) for name in _LLAMA3_FAMILY | _GLM4 | {"dbrx", "smaug-bpe"}},
    **{name: (_QWEN2_SPLIT,) for name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2",
                                          "megrez", "stablelm2", "hunyuan")},
    "qwen35": (_QWEN35_SPLIT,),
    **{name: (_GPT4O_SPLIT,) for name in ("gpt-4o", "llama4", "kanana2", "minimax-m2")},
    "tekken": (_TEKKEN_SPLIT,),
    # Every digit alone, then GPT-2's regex.
    **{name: (r"\p{N}", GPT2_SPLIT) for name in ("smollm", "starcoder", "refact", "command-r",
                                                 "codeshell", "exaone", "minerva-7b")},
    # Punctuation runs first, then GPT-2's regex, then digit runs cut into threes from the left
    # (Falcon's "3333" is "333" + "3").
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_SPLIT, "[0-9][0-9][0-9]"),
    # `\s+$` in llama.cpp's std::regex ends at the end of the piece; Oniguruma's `$` would also
    # stop before a newline, so it is written `\z` here (the first regex already isolated
    # newlines, so the two agree).
    "deepseek-llm": ("[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCT, r"\s+\z",
                     _DEEPSEEK_CJK, r"\p{N}+"),
    # `½` is \p{N}, not \p{P}: "4 ½" is "4", " ", "½" (GPT-2's regex keeps " ½" whole).
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}"),
}

# llama.cpp looks a whole pre-tokenized word up in the vocabulary before merging for these
# (Llama 3's tokenizer.json says `ignore_merges: true`); the result can differ from plain BPE.
IGNORE_MERGES = _LLAMA3_FAMILY | (_GLM4 - {"chatglm-bpe"}) | {"tekken"}
# llama.cpp adds BOS for these unless `tokenizer.ggml.add_bos_token` says otherwise.
ADD_BOS_BY_DEFAULT = _LLAMA3_FAMILY | {"tekken"}


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Split text as llama.cpp does for pre-tokenizer `pre`, then spell it in GPT-2's byte
    alphabet (a name llama.cpp does not know gets GPT-2's regex, as HF's converter does)."""
    regexes = SPLITS.get(pre, (GPT2_SPLIT,))
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def newline_runs_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Gemma 4's only split: lines and runs of newlines (llama.cpp: `[^\\n]+|[\\n]+`); BPE then
    runs on each whole line, spaces spelled `▁`."""
    return pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
