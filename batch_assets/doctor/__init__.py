"""`batch-assets doctor`: a preflight of what a first run needs, one line per check with the setting
to change (report.py); the checks by what they look at: the Dagster instance and its run launcher
(instance_checks.py), GPUs (gpus.py), models (models.py), drops, outputs and the result cache
(storage_checks.py), the cluster's permissions (cluster.py); run.py lists them in order.
"""
