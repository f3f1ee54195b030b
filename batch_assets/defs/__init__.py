"""The Dagster definitions tree of this project (`dg` conventions): each folder holds a component
instance (`defs.yaml`). `tasks/` turns every task YAML into its asset group, checks, job and sensor."""
