"""The megatron-core trainer backend (``backend.MegatronBackend``) and its parts: ``model`` (config, chunks),
``spec`` (layer specs), ``convert`` / ``weights`` (HF <-> megatron tensors, gathered), ``packing`` and
``logprobs`` (THD micro-batches, vocab-parallel log-probs), ``offload``, ``checkpoint``, ``families``."""
