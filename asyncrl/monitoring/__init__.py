"""Run monitoring: metrics files, wandb, the progress bar, Ray metrics and plots."""
