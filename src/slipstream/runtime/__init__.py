"""Running a model: the engine (prefill/decode), KV cache, sampler and generation loop."""
