"""`batch-assets serve`: OpenAI's Files and Batches API over this project's tasks (docs/serve.md).

store (files and batches on disk under `$DAGSTER_HOME/serve`, ids never paths), objects (OpenAI's
file, batch, list and error shapes), uploads (multipart read with a size limit, checked before it is
stored), batch_runs (each batch a partition of the `openai_batch` task, run one at a time through
`batch-assets run`), app (the FastAPI routes and the bearer key), command (one command starts it all).
"""
