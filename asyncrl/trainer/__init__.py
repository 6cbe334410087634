"""Trainer ranks: megatron-core model, losses, optimizer, checkpoints and the weight broadcast."""
