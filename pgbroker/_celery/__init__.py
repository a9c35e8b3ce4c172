"""What runs in Celery's own processes: which broker an app uses, eager mode, a task's failure
and its ending recorded, ``complete()``, the worker's diagnostics, inspect and prefetch hooks."""
