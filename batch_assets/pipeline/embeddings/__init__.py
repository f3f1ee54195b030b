"""Embedding tasks and similarity labels: texts in, vectors out, pure functions over frames; the
`("records", "embed")` and `("records", "similarity")` kinds of task.

`output.kind: embedding` sends each row's text (the task's template over its input fields, no chat
template) to an embedding model on vLLM's pooling runner; `validated_labels` gets an `embedding`
column (fixed-size float32) instead of a label. `output.method: similarity` on a choices task labels
each row by the cosine similarity of its embedding to each choice's.

Both go through the same inference loop as generated labels (`run_inference`: deduplication, the
result cache, checkpoints, resume, ranges of partitions): an engine returns a `Generation.vector`,
which the loop keeps as text (pipeline/result_stores.py's `encode_vector`), so the stores that keep
results need no second schema (and results stored before read as they are).

    prompts.py     raw_prompts → formatted_prompts (`format_embedding_prompts`: empty, too long, cut,
                   mostly unknown tokens) and the engine's prompts (`embedding_encoder`)
    results.py     an embedding task's inference_outputs and result table (`embedding_outputs`,
                   `validate_embeddings`) and what its checks check (`embedding_report`)
    similarity.py  similarity labels (`similarity_outputs`) and the choices' own partition
    formats.py     the task formats of the kinds (`EmbeddingRecords`, `SimilarityRecords`, and
                   `EmbeddedRecords`, what they share with the cascade's)

Also used by the cascade (pipeline/cascade/: its rows are embedded as these are) and by OpenAI
batch embedding lines (pipeline/openai_batch/).
"""
