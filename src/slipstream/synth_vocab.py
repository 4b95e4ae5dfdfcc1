"""The tokenizer and chat template of synthesized files (synth.py): a valid byte-level BPE
(GPT-2 byte alphabet, letter-pair merges, Llama-3 style special tokens), so the files load in
slipstream, in llama.cpp and in transformers."""

from __future__ import annotations

from .modelfile.vocab import bytes_to_unicode


def build_vocab(vocab: int) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    """tokens, token types, merges and special ids of a byte-level BPE with `vocab` tokens."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                "<|end_header_id|>"]
    alphabet = [bytes_to_unicode()[b] for b in range(256)]  # GPT-2's byte alphabet
    letters = [c for c in "etaoinshrdlucmfwypvbgkjqxz"]
    space = alphabet[ord(" ")]
    merges, pieces = [], []
    for a in [space] + letters:
        for b in letters:
            merges.append(f"{a} {b}")
            pieces.append(a + b)
    n_regular = vocab - len(specials)
    tokens = (alphabet + pieces)[:n_regular]
    merges = merges[: max(0, len(tokens) - 256)]
    while len(tokens) < n_regular:
        tokens.append(f"<|reserved_{len(tokens)}|>")
    types = [1] * len(tokens)
    for i, t in enumerate(tokens):
        if t.startswith("<|reserved_"):
            types[i] = 3
    ids = {}
    for s in specials:
        ids[s] = len(tokens)
        tokens.append(s)
        types.append(3)
    return tokens, types, merges, ids


LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")
