"""The runs the drops sensor requests (lib/drops_sensor.py): one run per file or shard, or one per
range of adjacent partitions, with the tags that say which file version each reads; a big file's
split run. `batch-assets run` and the range-failure sensor group partitions and read the tags the
same way."""

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import dagster as dg

from batch_assets.lib.split_job import split_run_config
from batch_assets.storage.drop_files import (
    DropFile,
    version_digest,
)

SOURCE_FILE_TAG = "batch_assets/source_file"
SOURCE_VERSION_TAG = "batch_assets/source_version"
REPLACED_TAG = "batch_assets/replaced_file"
LAUNCHED_BY_TAG = "batch_assets/launched_by"
# How Dagster tags a run over a range of partitions (the partitions' order decides what lies between).
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"


def run_request_for(
    drop: DropFile,
    replaced: bool,
    job_tags: Mapping[str, str] | None = None,
    partition_key: str | None = None,
    job_name: str | None = None,
) -> dg.RunRequest:
    """The run of one partition of `drop`: the file's own, or `partition_key`, one of its shards."""
    partition_key = partition_key or drop.partition_key
    digest = version_digest(drop.version)
    tags = {
        **(job_tags or {}),
        SOURCE_FILE_TAG: drop.relative_path,
        SOURCE_VERSION_TAG: digest,
        LAUNCHED_BY_TAG: "sensor",
    }
    if replaced:
        tags[REPLACED_TAG] = "true"
    return dg.RunRequest(run_key=f"{partition_key}@{digest}", job_name=job_name, partition_key=partition_key, tags=tags)


def range_run_request_for(
    keys: list[str],
    versions: Mapping[str, str],
    replaced: bool,
    job_tags: Mapping[str, str] | None = None,
    job_name: str | None = None,
) -> dg.RunRequest:
    """One run over the partitions `keys` (adjacent in the partitions' order, first to last), tagged
    the way Dagster tags a range run of a backfill. Its run key names the range and a digest of every
    file version in it, so Dagster launches it at most once."""
    identity = "\n".join(f"{key}@{version_digest(versions[key])}" for key in keys)
    digest = hashlib.sha1(identity.encode("utf-8")).hexdigest()[:16]
    tags = {
        **(job_tags or {}),
        RANGE_START_TAG: keys[0],
        RANGE_END_TAG: keys[-1],
        LAUNCHED_BY_TAG: "sensor",
    }
    if replaced:
        tags[REPLACED_TAG] = "true"
    return dg.RunRequest(run_key=f"{keys[0]}..{keys[-1]}@{digest}", job_name=job_name, tags=tags)


def split_run_request(drop: DropFile, task: str, job_name: str) -> dg.RunRequest:
    """The run that splits this version of `drop` off the tick (lib/split_job.py)."""
    tags = {SOURCE_FILE_TAG: drop.relative_path, SOURCE_VERSION_TAG: version_digest(drop.version)}
    return dg.RunRequest(
        run_key=f"split:{drop.partition_key}@{version_digest(drop.version)}",
        job_name=job_name,
        run_config=split_run_config(task, drop.partition_key),
        tags={**tags, LAUNCHED_BY_TAG: "sensor"},
    )


def even_chunks(keys: Sequence[str], max_per_run: int) -> list[list[str]]:
    """`keys` in as few chunks of at most `max_per_run` as possible, their sizes at most one apart
    (20 keys at 16: 10 + 10, not 16 + 4, so neither run waits long on the other's engine work)."""
    count = -(-len(keys) // max_per_run)
    size, longer = divmod(len(keys), count) if count else (0, 0)
    chunks, start = [], 0
    for index in range(count):
        end = start + size + (1 if index < longer else 0)
        chunks.append(list(keys[start:end]))
        start = end
    return chunks


def partition_ranges(
    ordered_keys: Sequence[str], wanted: Iterable[str], max_per_run: int, alone: Iterable[str] = ()
) -> list[list[str]]:
    """`wanted` split into runs: ranges of keys adjacent in the partitions' order (dynamic
    partitions: the order they were added), each of at most `max_per_run` keys. A range start..end
    covers every key between, so a key not wanted ends a range; a stretch of adjacent wanted keys
    over the cap becomes as few ranges as the cap allows, of even sizes (a multi-run backfill from
    the UI fills its runs in order instead: 16 + 4). Keys in `alone` (shards of big files, each as
    large as a run should hold) get a run each."""
    wanted, alone = set(wanted), set(alone)
    stretches: list[list[str]] = [[]]
    for key in ordered_keys:
        if key in alone and key in wanted:
            stretches += [[key], []]
        elif key in wanted:
            stretches[-1].append(key)
        elif stretches[-1]:
            stretches.append([])
    return [chunk for stretch in stretches for chunk in even_chunks(stretch, max_per_run)]


def requested_partitions(request: dg.RunRequest, ordered_keys: Sequence[str]) -> list[str]:
    """The partitions a request of this sensor covers: a run's one, or every key of its range in
    the partitions' order `ordered_keys`."""
    if request.partition_key:
        return [request.partition_key]
    start, end = request.tags[RANGE_START_TAG], request.tags[RANGE_END_TAG]
    return list(ordered_keys[ordered_keys.index(start) : ordered_keys.index(end) + 1])


def run_requests_for(
    to_run: list[tuple[DropFile, bool]],
    ordered_keys: Sequence[str],
    max_partitions_per_run: int,
    job_tags: Mapping[str, str] | None = None,
    keys_of: Callable[[DropFile], list[str]] = lambda drop: [drop.partition_key],
    job_name: str | None = None,
) -> list[dg.RunRequest]:
    """New and replaced files apart, each split into ranges of adjacent partitions (`ordered_keys`:
    every partition in order, the tick's new ones included) of up to `max_partitions_per_run`: one
    run per range, a lone file's run with its own partition key. A file split into shards
    (`keys_of`) has a run per shard."""
    requests = []
    for replaced in (False, True):
        drops = {key: drop for drop, is_replaced in to_run if is_replaced == replaced for key in keys_of(drop)}
        shards = [key for key, drop in drops.items() if key != drop.partition_key]
        for keys in partition_ranges(ordered_keys, drops, max_partitions_per_run, alone=shards):
            if len(keys) == 1:
                drop = drops[keys[0]]
                requests.append(run_request_for(drop, replaced, job_tags, partition_key=keys[0], job_name=job_name))
            else:
                versions = {key: drops[key].version for key in keys}
                requests.append(range_run_request_for(keys, versions, replaced, job_tags, job_name=job_name))
    return requests
