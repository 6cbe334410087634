"""Reward services of a run: models that score samples and are never trained."""
