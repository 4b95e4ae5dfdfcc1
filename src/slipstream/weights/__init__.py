"""Weight objects the model math calls (linear layers, embeddings) and the loader that builds
them from a GGUF file for a device. This is where formats meet the model, and nowhere else."""

from .linear import DenseLinear, Linear, QuantEmbedding
from .loader import ModelWeights, load_weights

__all__ = ["DenseLinear", "Linear", "ModelWeights", "QuantEmbedding", "load_weights"]
