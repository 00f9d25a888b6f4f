"""The megatron-core trainer backend's parts: model construction (``model``, ``spec``), weight
conversion between Hugging Face and Megatron layouts (``convert``, ``weights``), packed micro-batches
(``packing``) and vocab-parallel log-probs (``logprobs``). Importing this package needs megatron-core
(the ``megatron`` extra)."""
