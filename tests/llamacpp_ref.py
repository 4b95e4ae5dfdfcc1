"""llama.cpp (through llama-cpp-python, on the CPU) as a logits reference: an implementation
that shares no code with slipstream or transformers, and is the one GGUF files are made for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def llamacpp_logits(path: str | Path, ids: list[int], n_threads: int = 2) -> torch.Tensor:
    """llama.cpp's logits at every position of `ids` (one batch, no BOS added), float32,
    shape (len(ids), vocab).

    The KV cache is float32 rather than llama.cpp's default float16, and flash attention is
    off, so that the one rounding left on llama.cpp's side is its quantized matmuls (it
    quantizes activations to 8 bits: vec_dot_q8_0_q8_0 for Q8_0 weights, q4_1 x q8_1 for
    Q4_1), not its attention."""
    import llama_cpp  # optional: only tests that import this module need it

    n = len(ids)
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=n, n_batch=n,
                          n_ubatch=n, n_threads=n_threads, n_threads_batch=n_threads,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                          flash_attn=False, verbose=False)
    try:
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[:n], dtype=np.float32))
    finally:
        llm.close()


def llamacpp_tokens(path: str | Path, text: str) -> list[int]:
    """llama.cpp's token ids of `text` (BOS/EOS as the file asks, control tokens parsed), from
    the vocabulary alone."""
    import llama_cpp  # optional, as above

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode(), add_bos=True, special=True)
    finally:
        llm.close()


def unname(path: Path, arch: str) -> Path:
    """Take the architecture out of the file's general.name, in place: llama.cpp sets some
    token attributes by model name, and for a name with "phi3" in it looks up "</s>", "<unk>",
    "<s>" and "<|endoftext|>", which the synthetic Llama-3-style vocabulary lacks (the load
    fails with unordered_map::at). Same length, so the header keeps its layout."""
    data = path.read_bytes()
    name = f"slipstream-synth-{arch}-".encode()
    assert data.count(name) == 1, "general.name is not where this expects it"
    path.write_bytes(data.replace(name, f"slipstream-synth-{'x' * len(arch)}-".encode()))
    return path


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm of the difference over the norm of the reference."""
    return float((ours - ref).norm() / ref.norm())


def decisive(ref: torch.Tensor, margin: float) -> torch.Tensor:
    """The positions whose top-1 token the reference decides by more than `margin` times the
    position's logit scale (the standard deviation of its logits over the vocabulary): where
    the gap between its best two logits is smaller, two implementations that each round
    differently may legitimately pick different tokens."""
    top2 = ref.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) > margin * ref.std(dim=-1)


def assert_matches(ours: torch.Tensor, ref: torch.Tensor, tol: float, gap: float) -> None:
    """ours within `tol` relative of llama.cpp's `ref`, and the same top-1 token wherever the
    reference decides it (`decisive(ref, gap)`, at least half the positions)."""
    assert rel_err(ours, ref) < tol, rel_err(ours, ref)
    keep = decisive(ref, gap)
    assert keep.float().mean() > 0.5
    assert not ((ours.argmax(-1) != ref.argmax(-1)) & keep).any()
