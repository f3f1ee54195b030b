"""An image task's rows get their images' bytes here (`input.image_fields`), read as the drop file is.

A relative path is read from the drop zone exactly as a drop file is (`drop_files.read_zone_file`:
locally no link followed anywhere below the data root, regular files only); an `s3://` URI only in
the bucket of the data root (`BATCH_ASSETS_DATA`), with the same storage settings; a `data:` URL or
a parquet binary cell needs no reading. What cannot become an image is the row's error
(pipeline/inputs/images.py names the codes), never the partition's failure: one row per record always.
"""

from __future__ import annotations

import errno

import polars as pl
from upath import UPath

from batch_assets.pipeline.inputs.images import (
    DIGEST_COLUMN,
    IMAGES_COLUMN,
    PIXELS_COLUMN,
    ImageInputError,
    ImageSource,
    check_image,
    image_digest,
    image_error,
    image_source,
)
from batch_assets.pipeline.inputs.read_prompts import DropFileError
from batch_assets.pipeline.task_spec.input import InputSpec
from batch_assets.storage.drop_files import DropFile, read_zone_file
from batch_assets.storage.errors import StorageError
from batch_assets.storage.locations import data_root, is_local, storage_path


def attach_images(frame: pl.DataFrame, drop: DropFile, spec: InputSpec) -> pl.DataFrame:
    """raw_prompts rows with `images` (each image field's bytes, in order), `image_digest` and
    `image_pixels`; a row whose image cannot be used keeps its first error and no images."""
    missing = [field for field in spec.image_fields if field not in frame.columns]
    if missing:
        raise DropFileError(
            f"{drop.relative_path}: image field(s) {missing} not found; columns found: "
            f"{[c for c in frame.columns if c not in ('row_id', 'source_line', 'error')]}"
        )
    images: list[list[bytes] | None] = []
    digests: list[str | None] = []
    pixels: list[int | None] = []
    errors = frame["error"].to_list()
    columns = [frame[field].to_list() for field in spec.image_fields]
    for index, line in enumerate(frame["source_line"].to_list()):
        row: list[bytes] = []
        count = 0
        for field, values in zip(spec.image_fields, columns, strict=True):
            if errors[index] is not None:
                break
            try:
                data = _image_bytes(image_source(values[index], drop.relative_path), drop, spec.images.max_bytes)
                count += check_image(data, spec.images)
            except ImageInputError as exc:
                errors[index] = image_error(exc.code, drop.relative_path, line, field, exc.cause)
                break
            row.append(data)
        ok = errors[index] is None
        images.append(row if ok else None)
        digests.append(image_digest(row) if ok else None)
        pixels.append(count if ok else None)
    return frame.with_columns(
        pl.Series(IMAGES_COLUMN, images, dtype=pl.List(pl.Binary)),
        pl.Series(DIGEST_COLUMN, digests, dtype=pl.String),
        pl.Series(PIXELS_COLUMN, pixels, dtype=pl.Int64),
        pl.Series("error", errors, dtype=pl.String),
    )


def _image_bytes(source: ImageSource, drop: DropFile, max_bytes: int) -> bytes:
    if source.inline is not None:
        return source.inline
    if source.path is not None:
        try:
            return read_zone_file(drop.zone, source.path, max_bytes)
        except (FileNotFoundError, NotADirectoryError):
            raise ImageInputError("image_not_found", f"no file {source.path} in the drop zone") from None
        except DropFileError as exc:  # a link, a FIFO, a folder: never followed or read
            raise ImageInputError("unsafe_image_path", str(exc)) from None
        except OSError as exc:
            if exc.errno != errno.ENAMETOOLONG:
                raise  # the drop zone's storage failing is no one row's fault
            raise ImageInputError(
                "image_not_found", f"no file {source.path[:80]}...: a name longer than the file system allows"
            ) from None
    assert source.s3 is not None
    return _s3_bytes(source.s3, max_bytes)


def _s3_bytes(uri: str, max_bytes: int) -> bytes:
    root = data_root()
    bucket = uri[len("s3://") :].split("/", 1)[0]
    if is_local(root) or UPath(str(root)).path.split("/", 1)[0] != bucket:
        where = "a local data root" if is_local(root) else f"bucket {UPath(str(root)).path.split('/', 1)[0]}"
        raise ImageInputError(
            "image_url_not_allowed", f"{uri[:120]}: S3 images are read from the data root's bucket only ({where})"
        )
    path = storage_path(uri)
    try:
        size = path.fs.size(path.path)
        if size is not None and size > max_bytes:
            raise ImageInputError("image_too_large", f"{size} bytes, over input.images.max_bytes {max_bytes}")
        return path.fs.cat_file(path.path)
    except FileNotFoundError:
        raise ImageInputError("image_not_found", f"no S3 object {uri[:120]}") from None
    except (OSError, StorageError) as exc:
        raise ImageInputError("image_not_found", f"{uri[:120]} cannot be read ({exc})") from None
