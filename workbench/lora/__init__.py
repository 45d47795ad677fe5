"""Multi-LoRA serving: ``LoRARequest`` (a public type, torch-free) here and in ``request``;
the adapters' loading, slots and batched low-rank update in ``models``, ``layers`` and
``worker_manager`` (torch, one layer above the model)."""
