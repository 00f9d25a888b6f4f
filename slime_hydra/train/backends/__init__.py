"""Trainer backends, one folder each behind :class:`slime_hydra.train.backend.TrainerBackend`.

- ``torch/``: a Hugging Face causal LM, AdamW, data parallel (``backend.py``), its PPO critic
  (``critic.py``) and host offload (``offload.py``).
- ``megatron/``: megatron-core (tensor, pipeline, context and expert parallel; ``backend.py`` and the
  model, spec, conversion, packing and log-prob parts beside it).

A new backend is a new folder here, its line in ``slime_hydra.train.backend.BACKENDS`` and
``conf/trainer/<name>.yaml``. Backends are imported only when a trainer rank starts.
"""
