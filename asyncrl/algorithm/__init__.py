"""The RL math: group advantages and policy losses. Plain torch, no actors, no megatron."""
