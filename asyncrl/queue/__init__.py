"""The message queue between rollout workers and the trainer."""
