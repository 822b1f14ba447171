"""A Hugging Face data set on disk (`data=hf`): a `save_to_disk` folder, parquet files and the
`imagefolder` builder give the same training; every mode reads it; mistakes are one line.
Never a download: everything is made here from an image folder (tests/helpers/images.py)."""

from __future__ import annotations

import os
import sys

import pytest

from app.errors import UserError
from conftest import HELPERS, assert_same_weights, load_state, read_metrics, run_job

sys.path.insert(0, str(HELPERS))
from images import CLASSES, make_image_folder  # noqa: E402

SMALL = ["data=hf", "model=resnet", "model.channels=[8,16]", "data.image_size=16",
         "data.batch_size=8", "trainer.max_epochs=2", "trainer.log_every_n_steps=1",
         "trainer.progress_bar=false"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same 36 images as an image folder, a save_to_disk folder and a parquet file."""
    base = tmp_path_factory.mktemp("hf")
    os.environ.setdefault("HF_HOME", str(base / "hf-home"))  # (its cache, not the user's)
    # Offline, as app.data.hf sets it before datasets is imported (here the tests import it
    # first): without it, a builder that is not on disk waits for the Hub.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    make_image_folder(base / "folder")
    loaded = datasets.load_dataset("imagefolder", data_dir=str(base / "folder"))
    loaded.save_to_disk(str(base / "saved"))
    (base / "parquet").mkdir()
    loaded["train"].to_parquet(str(base / "parquet" / "train-00000-of-00001.parquet"))
    return base


def test_saved_parquet_and_imagefolder_sources_train_alike(sources, tmp_path) -> None:
    runs = [run_job(tmp_path / name, *SMALL, f"data.path={sources / name}", *extra)
            for name, extra in (("saved", []), ("parquet", []),
                                ("folder", ["data.builder=imagefolder"]))]
    assert "data.path=" in runs[0].output and "29 training and 7 validation" in runs[0].output
    metrics = [read_metrics(r.run_dir) for r in runs]
    assert metrics[0] and metrics[0] == metrics[1] == metrics[2]
    assert load_state(runs[0].run_dir / "checkpoints" / "last.pt")["data"]["classes"] == list(
        CLASSES)


def test_every_mode_reads_a_saved_dataset(sources, tmp_path) -> None:
    resumable = [*SMALL, f"data.path={sources / 'saved'}", "data.num_workers=2",
                 "trainer.ckpt_every_n_steps=2", "trainer.keep_last=100",
                 "+callbacks/eval_visuals=default"]
    trained = run_job(tmp_path / "train", *resumable).run_dir
    assert (trained / "eval_visuals" / "step-00000006.png").is_file()
    source = trained / "checkpoints" / "step-00000004.pt"  # mid-epoch 2, augmented, 2 workers
    resumed = run_job(tmp_path / "resumed", *resumable, f"resume={source}").run_dir
    assert_same_weights(trained / "checkpoints" / "last.pt", resumed / "checkpoints" / "last.pt")
    best = trained / "checkpoints" / "best.pt"
    common = [*SMALL, f"data.path={sources / 'saved'}", f"ckpt={best}"]
    recorded = load_state(best)["metrics"]["acc"]
    assert run_job(tmp_path / "eval", *common, "trainer=eval").value == recorded
    assert run_job(tmp_path / "predict", *common, "trainer=predict").value == recorded
    exported = run_job(tmp_path / "export", *common, "trainer=export").run_dir
    assert (exported / "export" / "model.pt2").is_file()


def test_a_validation_split_and_string_labels(sources, tmp_path) -> None:
    import datasets

    rows = datasets.load_from_disk(str(sources / "saved"))["train"]
    names = rows.features["label"].names
    as_text = rows.map(lambda row: {"name": names[row["label"]]}).remove_columns("label")
    parts = as_text.train_test_split(test_size=0.25, seed=0)
    datasets.DatasetDict({"train": parts["train"], "validation": parts["test"]}).save_to_disk(
        str(tmp_path / "named"))
    job = run_job(tmp_path / "run", *SMALL, f"data.path={tmp_path / 'named'}",
                  "data.label_column=name", "trainer.max_epochs=1")
    assert "27 training and 9 validation images" in job.output  # its own split


@pytest.mark.parametrize(("override", "words"), [
    ("data.path=/nonexistent/set", "data.path=/nonexistent/set: no such file or folder"),
    ("data.image_column=picture", "data.image_column=picture: .* has the columns image, label"),
    ("data.train_split=training", "data.train_split=training: .* has the splits train"),
    ("data.val_split=dev", "data.val_split=dev: .* has the splits train"),
])
def test_a_mistake_is_one_line_naming_it(sources, tmp_path, override, words) -> None:
    overrides = [*SMALL, f"data.path={sources / 'saved'}", override]
    with pytest.raises(UserError, match=words) as raised:
        run_job(tmp_path / "run", *overrides)
    assert "\n" not in str(raised.value)


def _rows_of(sources):
    import datasets

    return datasets.load_from_disk(str(sources / "saved"))["train"]


def test_an_unlabelled_test_split_is_not_taken_for_validation(sources, tmp_path) -> None:
    import datasets

    rows = _rows_of(sources)
    unlabelled = rows.select(range(6)).map(lambda row: {"label": -1})  # the Hub's convention
    datasets.DatasetDict({"train": rows, "test": unlabelled}).save_to_disk(str(tmp_path / "d"))
    job = run_job(tmp_path / "run", *SMALL, f"data.path={tmp_path / 'd'}",
                  "trainer.max_epochs=1")
    assert "29 training and 7 validation images" in job.output  # a share of train instead
    with pytest.raises(UserError, match="row 0 of split test has the label '-1'"):
        run_job(tmp_path / "asked", *SMALL, f"data.path={tmp_path / 'd'}", "data.val_split=test")


def test_images_as_bytes_or_paths_and_numbered_labels(sources, tmp_path) -> None:
    import datasets

    rows = _rows_of(sources)
    files = sorted((sources / "folder").rglob("*.*"))
    labels = [i % 12 for i in range(len(files))]  # 12 classes numbered 0 to 11
    table = {"raw": [f.read_bytes() for f in files], "where": [str(f) for f in files],
             "number": labels}
    datasets.Dataset.from_dict(table).save_to_disk(str(tmp_path / "d"))
    for column in ("raw", "where"):
        job = run_job(tmp_path / column, *SMALL, f"data.path={tmp_path / 'd'}",
                      f"data.image_column={column}", "data.label_column=number",
                      "trainer.max_epochs=1")
        assert "12 classes (0, 1, 2, 3, 4, 5, 6, 7 ... (12))" in job.output  # 2 before 10
    assert len(rows) == len(files)


@pytest.mark.parametrize(("overrides", "words"), [
    (["data.label_column=image"], "data.label_column=image: not a column of labels"),
    (["data.image_column=label"], "data.image_column=label: not a column of images"),
    (["data.builder=bogus"], "data.path="),
])
def test_columns_of_the_wrong_kind_are_one_line(sources, tmp_path, overrides, words) -> None:
    with pytest.raises(UserError, match=words) as raised:
        run_job(tmp_path / "run", *SMALL, f"data.path={sources / 'saved'}", *overrides)
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 400


def test_a_validation_label_that_training_lacks_is_named(sources, tmp_path) -> None:
    import datasets

    rows = _rows_of(sources).map(lambda row: {"name": ["a", "b", "c"][row["label"]]})
    rows = rows.remove_columns("label")
    val = rows.select(range(4)).map(lambda row: {"name": "d"})
    datasets.DatasetDict({"train": rows, "validation": val}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(UserError, match="row 0 of split validation has the label 'd'"):
        run_job(tmp_path / "run", *SMALL, f"data.path={tmp_path / 'd'}", "data.label_column=name")


def test_an_unreadable_row_stops_the_run_naming_it_or_is_skipped_and_counted(sources,
                                                                           tmp_path) -> None:
    import datasets

    files = sorted((sources / "folder").rglob("*.*"))
    raw = [f.read_bytes() for f in files]
    raw[3] = b"\xff\xd8\xff\xe0 the start of a JPEG only"
    table = {"raw": raw, "label": [f.parent.name for f in files]}
    datasets.Dataset.from_dict(table).save_to_disk(str(tmp_path / "d"))
    common = [*SMALL, f"data.path={tmp_path / 'd'}", "data.image_column=raw",
              "trainer.max_epochs=1"]
    # Met while the normalisation is computed (a training row) or while loading (either).
    with pytest.raises(Exception, match=r"row \d+ of column 'raw' \(bytes\) is not a readable "
                                        r"image.*data.bad_files=skip"):
        run_job(tmp_path / "fails", *common)
    job = run_job(tmp_path / "skips", *common, "data.bad_files=skip")
    assert "1 unreadable image(s) left out; the first: row 3 of column 'raw'" in job.output
    assert "28 training and 7 validation images" in job.output  # the share of 35, not of 36
