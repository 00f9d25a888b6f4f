"""Trainer backends, one folder each behind :class:`slime_hydra.train.backend.TrainerBackend`: ``torch/`` (a
Hugging Face causal LM, data parallel) and ``megatron/`` (megatron-core, model parallel). A new backend is a
folder here, its line in ``slime_hydra.train.backend.BACKENDS`` and ``conf/trainer/<name>.yaml``.
"""
