"""The plain way to embed a file: vLLM's offline `LLM.embed` over every text, vectors to parquet.

    python bench/plain_embed_script.py texts.jsonl out.parquet [--model FOLDER]

What bench/bench_embeddings.py compares `batch-assets run embeddings` with: the same model (the
embedded all-MiniLM-L6-v2 unless --model), dtype float32 and eager mode as the task runs it, a KV
cache sized as the pipeline sizes it on a CPU (2 GiB). Prints one JSON line: rows and embed seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

if __name__ == "__main__":  # vLLM spawns processes
    parser = argparse.ArgumentParser()
    parser.add_argument("texts")
    parser.add_argument("out")
    parser.add_argument("--model")
    args = parser.parse_args()

    import polars as pl
    from vllm import LLM

    from batch_assets.engines.embedded_model import embedding_model_dir

    texts = pl.read_ndjson(args.texts)["text"].to_list()
    llm = LLM(
        model=args.model or str(embedding_model_dir()),
        runner="pooling",
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=2 << 30,
    )
    started = time.perf_counter()
    outputs = llm.embed(texts, use_tqdm=False)
    seconds = time.perf_counter() - started
    vectors = [output.outputs.embedding for output in outputs]
    pl.DataFrame(
        {"text": texts, "embedding": vectors}, schema={"text": pl.String, "embedding": pl.List(pl.Float32)}
    ).write_parquet(args.out)
    print(json.dumps({"rows": len(texts), "embed_seconds": seconds}), flush=True)
    # vLLM's `LLM` can abort in its own teardown at interpreter exit ("terminate called without an
    # active exception"), so leave without it once everything is written; but stop the engine core
    # process first: `os._exit` skips the finalizer that would, and an orphaned core keeps its memory.
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)
