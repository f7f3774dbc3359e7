"""Quality evaluation: task generators (tasks.py) shared with training."""
