"""The megatron-core trainer backend: ``backend.MegatronBackend`` and its parts.

- ``backend``: the :class:`~slime_hydra.train.backend.TrainerBackend` (distributed optimizer, offload,
  dist-checkpointing checkpoints, the weight export to the engines).

- ``families``: what we know about Hugging Face configs (supported ``model_type``s, MoE layers, rope,
  vocabulary padding); no megatron-core import.
- ``model``: ``transformer_config(hf, Parallel(...), overrides=...)`` and ``build_gpt_model(hf, config, ...)``.
- ``spec``: our module spec (SDPA / varlen flash attention without Transformer Engine, TE when present),
  ``stage_layers`` (megatron's pipeline split).
- ``convert``: HF <-> Megatron tensors, pure functions (``Layout``, ``Shard``, ``stage_shard``,
  ``hf_to_megatron``, ``megatron_to_hf``, ``split_tp`` / ``gather_tp``, ``HFCheckpoint``); torch only.
- ``weights``: ``load_hf_weights`` into model chunks, ``export_hf_weights`` gathered over TP / PP / EP and
  streamed in buckets (weight sync, ``hf/`` checkpoints).
- ``packing``: THD micro-batches by token budget (``pack_micro_batches``, ``PackedBatch``).
- ``logprobs``: chunked vocab-parallel log-probs and entropy (``packed_response_log_probs``).

``model``, ``spec`` and ``weights.load_hf_weights``' callers need megatron-core (the ``megatron`` extra).
"""
