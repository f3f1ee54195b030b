"""`batch-assets serve`: OpenAI's Files and Batches API over this project's tasks (docs/serve.md).

store (files and batches on disk under `$DAGSTER_HOME/serve`, ids never paths, files expiring),
objects (OpenAI's file, batch, list and error shapes), uploads (multipart read with a size limit and
the stored-bytes quota, checked before it is stored), batch_runs (each batch a partition of the
`openai_batch` task, run one at a time through `batch-assets run`, by a runner that outlives a
failed step; a deleted or expired file takes its batch's partition with it), run_child (that run,
killed when its server dies), app (the FastAPI
routes, the bearer key, cross-site refusals), command (one command starts it all).
"""
