"""multi_task_remote recipe: config only (hooks from recipes.multi_task; the remote env is scored by its server)."""
