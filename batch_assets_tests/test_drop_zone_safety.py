"""A local drop zone reads regular files only: links, FIFOs and odd names on a real file system.

Anyone who can write into a shared drop folder must not be able to make the pipeline read a file
outside it (a symbolic link to /etc/passwd), hang it (a FIFO), or crash its listing (a name that is
not UTF-8). Links are skipped whatever they point to, with a reason the sensor shows; a file
swapped for a link or a FIFO between listing and reading is refused when it is opened.
"""

from __future__ import annotations

import os
import shutil
import time
import unicodedata
from pathlib import Path

import dagster as dg
import pytest

from batch_assets.lib.drops_sensor import build_drops_sensor
from batch_assets.lib.run_requests import SOURCE_FILE_TAG
from batch_assets.lib.task_definitions import build_definitions, pipeline_job_name
from batch_assets.pipeline.inputs.read_prompts import DropFileError
from batch_assets.pipeline.task_spec import load_task_specs
from batch_assets.storage.drop_files import find_drop_file, list_drop_files, partition_key_for, skip_reason
from batch_assets.storage.errors import StorageError

TASK = "answers"
SECRET = "root:x:0:0:the secret outside the drop zone\n"
LINK_REASON = "symbolic link"


@pytest.fixture
def zone(data_dir: Path) -> Path:
    folder = data_dir / "drops" / TASK
    folder.mkdir(parents=True)
    (folder / "ok.txt").write_text("What is 2 + 2?\n", encoding="utf-8")
    return folder


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the drop zone holding a file the worker can read and the dropper must not."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "passwd.txt").write_text(SECRET, encoding="utf-8")
    return folder


def listed(zone_task: str = TASK) -> tuple[list[str], dict[str, str]]:
    files, skipped = list_drop_files(zone_task)
    return [drop.relative_path for drop in files], skipped


def test_links_of_every_kind_are_skipped_with_a_reason_and_never_read(zone: Path, outside: Path) -> None:
    (zone / "passwd.txt").symlink_to("/etc/passwd")
    (zone / "secret.txt").symlink_to(outside / "passwd.txt")
    (zone / "inside.txt").symlink_to("ok.txt")  # a link inside the zone: skipped too (regular files only)
    (zone / "dangling.txt").symlink_to(zone / "gone.txt")
    (zone / "linked_folder").symlink_to(outside, target_is_directory=True)
    (zone / "loop").symlink_to(".", target_is_directory=True)
    (zone / "sub").mkdir()
    (zone / "sub" / "relative.txt").symlink_to("../../../../outside/passwd.txt")

    names, skipped = listed()
    assert names == ["ok.txt"]
    for link in ("passwd.txt", "secret.txt", "inside.txt", "dangling.txt", "linked_folder", "loop", "sub/relative.txt"):
        assert LINK_REASON in skipped[link], (link, skipped[link])
    assert "linked_folder/passwd.txt" not in skipped  # a linked folder is not walked into

    # A partition registered for a link (e.g. before links were refused) fails with the reason,
    # as a file the drop zone cannot read, and never returns the target's bytes.
    for link in ("passwd.txt", "secret.txt", "sub/relative.txt"):
        with pytest.raises(DropFileError, match=LINK_REASON):
            find_drop_file(TASK, partition_key_for(link)).read_bytes()


def test_fifos_are_skipped_and_a_listing_never_blocks_on_them(zone: Path) -> None:
    os.mkfifo(zone / "pipe.txt")
    names, skipped = listed()
    assert names == ["ok.txt"]
    assert "FIFO" in skipped["pipe.txt"] and "not a regular file" in skipped["pipe.txt"]
    with pytest.raises(DropFileError, match="FIFO"):
        find_drop_file(TASK, "pipe.txt")


def test_a_file_swapped_for_a_link_or_a_fifo_after_listing_is_not_read(zone: Path, outside: Path) -> None:
    (zone / "sub").mkdir()
    (zone / "sub" / "nested.txt").write_text("nested question\n", encoding="utf-8")
    (zone / "piped.txt").write_text("soon a FIFO\n", encoding="utf-8")
    files, _ = list_drop_files(TASK)
    by_name = {drop.relative_path: drop for drop in files}
    assert sorted(by_name) == ["ok.txt", "piped.txt", "sub/nested.txt"]

    (zone / "ok.txt").unlink()
    (zone / "ok.txt").symlink_to(outside / "passwd.txt")
    with pytest.raises(DropFileError, match=LINK_REASON) as raised:
        by_name["ok.txt"].read_bytes()
    assert "ok.txt" in str(raised.value) and "root:x" not in str(raised.value)

    # A folder on the way swapped for a link to another folder holding a file of the same name.
    (outside / "nested.txt").write_text(SECRET, encoding="utf-8")
    (zone / "sub").rename(zone / "sub_moved")
    (zone / "sub").symlink_to(outside, target_is_directory=True)
    with pytest.raises(DropFileError, match=LINK_REASON):
        by_name["sub/nested.txt"].read_bytes()

    # A FIFO opened for reading would wait for a writer forever; it is refused at once.
    (zone / "piped.txt").unlink()
    os.mkfifo(zone / "piped.txt")
    started = time.monotonic()
    with pytest.raises(DropFileError, match="FIFO"):
        by_name["piped.txt"].read_bytes()
    assert time.monotonic() - started < 5


def test_a_removed_file_is_still_a_storage_error_naming_it(zone: Path) -> None:
    [drop], _ = list_drop_files(TASK)
    (zone / "ok.txt").unlink()
    with pytest.raises(StorageError, match="ok.txt failed: not found"):
        drop.read_bytes()


def test_a_name_that_is_not_utf8_is_skipped_without_breaking_the_listing(zone: Path) -> None:
    with open(os.path.join(os.fsencode(zone), b"bad\xff.txt"), "wb") as handle:
        handle.write(b"question\n")
    names, skipped = listed()
    assert names == ["ok.txt"]
    [(name, reason)] = skipped.items()
    assert "not valid UTF-8" in reason and name.startswith("bad")


def test_odd_names_are_listed_found_and_read_back_as_themselves(zone: Path) -> None:
    composed = unicodedata.normalize("NFC", "café.txt")
    decomposed = unicodedata.normalize("NFD", "café.txt")
    names = {
        "with spaces  .txt": "spaces",
        "日本語 😀.txt": "unicode",
        composed: "nfc",
        decomposed: "nfd",  # looks the same, is another name: another file, another partition
        "Case.txt": "upper",
        "case.txt": "lower",
        "x..y.txt": "two dots inside",
        "n" * 251 + ".txt": "longest name",
        "deep/" * 30 + "leaf.txt": "deep",
    }
    for name, text in names.items():
        path = zone / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")
    (zone / "..hidden.txt").write_text("hidden\n", encoding="utf-8")

    found, skipped = listed()
    assert sorted(found) == sorted([*names, "ok.txt"])
    assert "hidden" in skipped["..hidden.txt"]
    keys = {partition_key_for(name) for name in names}
    assert len(keys) == len(names)
    for name, text in names.items():
        drop = find_drop_file(TASK, partition_key_for(name))
        assert (drop.relative_path, drop.read_bytes()) == (name, (text + "\n").encode("utf-8"))


@pytest.mark.parametrize("name", ["../x.txt", "a/../x.txt", "./x.txt", "a/./x.txt", "..", "a/.."])
def test_dot_segments_are_refused_as_unsafe_names(name: str) -> None:
    reason = skip_reason(name)
    assert reason is not None and "unsafe name" in reason


def test_the_sensor_runs_regular_files_and_names_the_links_it_skips(zone: Path, outside: Path) -> None:
    (zone / "passwd.txt").symlink_to("/etc/passwd")
    os.mkfifo(zone / "pipe.txt")
    task = next(task for task in load_task_specs() if task.name == TASK)
    defs = build_definitions()
    sensor = build_drops_sensor(task, defs.resolve_job_def(pipeline_job_name(TASK)))
    with dg.instance_for_test() as instance:
        # ok.txt was written just now (still being copied in, for all the sensor knows): nothing runs,
        # and the tick says why each name was left alone.
        quiet = sensor(dg.build_sensor_context(instance=instance, cursor=None, definitions=defs))
        assert not quiet.run_requests
        message = quiet.skip_reason.skip_message
        assert "passwd.txt: symbolic link" in message and "pipe.txt: a FIFO" in message, message
        stamp = time.time() - 60
        os.utime(zone / "ok.txt", (stamp, stamp))
        result = sensor(dg.build_sensor_context(instance=instance, cursor=quiet.cursor, definitions=defs))
    [request] = result.run_requests
    assert request.tags[SOURCE_FILE_TAG] == "ok.txt"
    [partitions] = result.dynamic_partitions_requests
    assert list(partitions.partition_keys) == ["ok.txt"]


def test_a_zone_that_is_itself_a_link_is_the_configured_folder_and_is_read(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whoever sets BATCH_ASSETS_DATA may point it through a link (e.g. to a larger disk); only what
    # is inside the zone is the droppers'.
    real = tmp_path / "big_disk"
    (real / "drops" / TASK).mkdir(parents=True)
    (real / "drops" / TASK / "ok.txt").write_text("q\n", encoding="utf-8")
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.symlink_to(real, target_is_directory=True)
    [drop], skipped = list_drop_files(TASK)
    assert (drop.relative_path, drop.read_bytes(), skipped) == ("ok.txt", b"q\n", {})


def test_a_partition_whose_file_became_a_link_fails_its_run_without_reading_it(zone: Path, data_dir: Path) -> None:
    # The case: `ln -s /etc/passwd drops/answers/passwd.txt` had become a partition. Its run
    # now fails as an unreadable file, naming the reason, and stores nothing of the target.
    (zone / "passwd.txt").symlink_to("/etc/passwd")
    defs = build_definitions()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(f"{TASK}_drops", ["passwd.txt"])
        result = defs.resolve_job_def(pipeline_job_name(TASK)).execute_in_process(
            instance=instance,
            partition_key="passwd.txt",
            asset_selection=[dg.AssetKey([TASK, "raw_prompts"])],
            raise_on_error=False,
        )
    assert not result.success
    [failure] = [event for event in result.all_events if event.is_step_failure]
    message = failure.step_failure_data.error.to_string()
    assert "passwd.txt: symbolic link" in message and "root:" not in message
    assert not (data_dir / "storage" / TASK / "raw_prompts" / "passwd.txt.parquet").exists()


def test_a_task_folder_below_the_data_folder_that_is_a_link_is_refused(
    data_dir: Path, outside: Path, tmp_path: Path
) -> None:
    # Whoever can write into drops/ could swap drops/answers for a link to any folder of .txt files.
    (data_dir / "drops").mkdir(parents=True)
    (data_dir / "drops" / TASK).symlink_to(outside, target_is_directory=True)
    with pytest.raises(StorageError, match=rf"drops/{TASK} under BATCH_ASSETS_DATA is a symbolic link"):
        list_drop_files(TASK)
    with pytest.raises(StorageError, match="symbolic link"):
        find_drop_file(TASK, "passwd.txt")

    # Listed while the folder was real, swapped for a link before the read: refused when opened.
    (data_dir / "drops" / TASK).unlink()
    (data_dir / "drops" / TASK).mkdir()
    (data_dir / "drops" / TASK / "passwd.txt").write_text("a question\n", encoding="utf-8")
    [drop], _ = list_drop_files(TASK)
    shutil.rmtree(data_dir / "drops")
    (tmp_path / "fake_drops").mkdir()
    (tmp_path / "fake_drops" / TASK).symlink_to(outside, target_is_directory=True)
    (data_dir / "drops").symlink_to(tmp_path / "fake_drops", target_is_directory=True)
    with pytest.raises(DropFileError, match="drop zone folder drops: symbolic link"):
        drop.read_bytes()
