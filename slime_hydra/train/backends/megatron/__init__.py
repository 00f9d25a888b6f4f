"""The megatron-core trainer backend: ``backend.MegatronBackend`` and its parts.

- ``backend``: the :class:`~slime_hydra.train.backend.TrainerBackend` (passes, optimizer step, reference).
- ``model``: ``transformer_config``, ``build_gpt_model`` and a rank's model chunks (``build_chunks``).
- ``offload``: host offload of weights, gradients and optimizer state.
- ``checkpoint``: ``hf/`` and dist-checkpointing ``megatron/`` checkpoints, optimizer-state loading.
- ``families``: what we know about Hugging Face configs; no megatron-core import.
- ``spec``: our module spec (SDPA / varlen flash attention without Transformer Engine, TE when present).
- ``convert``: HF <-> Megatron tensors, pure torch functions (``Layout``, ``Shard``, ``HFCheckpoint``).
- ``weights``: ``load_hf_weights`` into model chunks, ``export_hf_weights`` gathered over TP / PP / EP.
- ``packing``: THD micro-batches by token budget; ``logprobs``: vocab-parallel log-probs and entropy.
"""
