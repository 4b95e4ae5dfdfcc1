"""Every error slipstream raises on purpose derives from SlipstreamError.

Each names the offending value and, where there is one, what to do about it, so the CLI can
print the message as one line and exit non-zero without a traceback.
"""

from __future__ import annotations


class SlipstreamError(Exception):
    """Base class of all deliberate slipstream errors."""


class GGUFError(SlipstreamError):
    """The file is not a usable GGUF file (bad magic, version, truncation, inconsistent sizes)."""


class UnsupportedTensorType(SlipstreamError):
    """A tensor uses a GGML type slipstream has no format for."""


class UnsupportedArchitecture(SlipstreamError):
    """`general.architecture` names a model family slipstream does not implement."""


class MissingMetadata(GGUFError):
    """A metadata key the model needs is absent."""


class ContextOverflow(SlipstreamError):
    """A prompt (plus requested tokens) does not fit the context window."""


class BudgetTooSmall(SlipstreamError):
    """A memory budget cannot hold the minimum the engine needs to run."""


class ModelNotFound(SlipstreamError):
    """A model path does not exist, or the default model could not be pulled."""


class TokenizerError(SlipstreamError):
    """The tokenizer metadata in the GGUF is unusable."""


class BadArgument(SlipstreamError, ValueError):
    """An argument (sampling parameter, device, context size, ...) is out of range."""


class DeviceNotFound(BadArgument):
    """A device the user named (cuda, cuda:N, ...) does not exist on this machine."""


class DraftMismatch(BadArgument):
    """A draft model for speculative decoding does not share the target's vocabulary."""


class MissingDependency(SlipstreamError):
    """An optional package a requested feature needs is not installed."""


def oom_summary(e: BaseException) -> str:
    """The first line of a CUDA out-of-memory error (what was asked, what was free), for
    one-line messages; torch's text goes on with allocator advice."""
    return (str(e).splitlines() or ["CUDA out of memory"])[0]


class PipelineBroken(SlipstreamError):
    """A process of a --distributed pipeline died or stopped answering (runtime.pipeline)."""


class NonFiniteLogits(SlipstreamError):
    """The model produced NaN or Inf logits: corrupt or out-of-range weights, most often."""


class GGUFLayoutError(GGUFError):
    """A count, length or offset in the GGUF header does not fit the file's bytes."""


class TensorInfoError(GGUFError):
    """A tensor's type, shape, size or data offset disagrees with the file's data section."""


class InvalidMetadata(GGUFError):
    """A metadata value has the wrong type or is out of range (hyper-parameters included)."""


class ChatTemplateLimitExceeded(TokenizerError):
    """A chat template ran past a bound on one render (a range's size, loop iterations and
    calls, time, the size of a string, list or number it builds, or of its output): it loops
    without end or explodes, so the file's template is unusable as it is."""


class ImageFileError(SlipstreamError):
    """A layer image file could not be written (read-only folder, full disk, bad cache path)."""


class CorruptTensorValues(GGUFError):
    """A tensor holds values no trained model has: a non-finite or absurd block scale, norm
    weight or bias (weights.checks). SLIPSTREAM_CHECK_WEIGHTS=0 loads such a file anyway."""


class MisnamedTensor(TensorInfoError):
    """A tensor the model reads where the file has it (a head apart from the embedding, QKV
    biases, Llama 3's RoPE divisors) is missing while an unused tensor of its shape or a near
    name is present, or some layers have a bias the others lack: a renamed tensor, which would
    otherwise make the model run without it (weights.checks)."""


class SlipstreamWarning(UserWarning):
    """Base class of the warnings slipstream issues on purpose (the CLI prints each as one
    `warning:` line)."""


class TensorWarning(SlipstreamWarning):
    """A load went on past something wrong with the file's tensors: tensors it does not use,
    or (SLIPSTREAM_CHECK_WEIGHTS=0) values or names that would otherwise refuse it."""


class RecurrentState(SlipstreamError, ValueError):
    """A step a model with recurrent layers (Qwen3.5's linear attention) cannot take: a state
    summed over the context cannot be rolled back or read at chosen positions, as a KV cache
    can (speculative trees, compaction, a rollback with no snapshot to restart from)."""
