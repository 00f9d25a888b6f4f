"""The torch trainer backend: ``backend.TorchBackend`` (Hugging Face model, AdamW, DDP), ``critic``
(PPO's value model) and ``offload`` (moving weights and optimizer state to the host and back)."""
