"""OpenAI Batch API request files in, its output and error files out: the `input.format:
openai_batch` kind of task, each line its own request.

Pure functions, no Dagster, no storage. A drop of such a task is a `.jsonl` file whose lines are

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 64, "temperature": 0, ...}}

(`/v1/completions` lines carry `body.prompt` instead of `messages`; `/v1/embeddings` lines carry
`body.input`, a text or a list of texts, for a task whose `output.kind` is `embedding`).

    protocol.py        the urls, the error codes of lines (each a bad request, HTTP 400), the raw_prompts schema
    lines.py           the file → raw_prompts rows (`read_batch_requests`), one per line, an error row per bad line
    body.py            a line's body: the fields honoured, what the row records of them
    field_checks.py    the fields' types on OpenAI's request types (the `openai` SDK's), their ranges on a
                       pydantic model
    messages.py        a chat line's messages, as checked and as the chat template renders them
    image_parts.py     a chat line's `image_url` parts (pipeline/inputs/images.py checks the pictures)
    sampling.py        each line's own sampling and output constraint (`RequestSpec`), part of its request key
    formatting.py      raw_prompts → formatted_prompts (`format_batch_prompts`, `format_batch_embedding_prompts`)
    engine_prompts.py  formatted rows → the engine's prompts (`batch_prompt_encoder`)
    output.py          validated rows and the batch output and error files (`batch_files`)
    formats.py         the task formats of the kind (`OpenAIBatchLines`, `OpenAIBatchEmbeddings`)
"""
