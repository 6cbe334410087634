"""Model operations in torch that both the engine and the trainer run (bottom layer)."""
