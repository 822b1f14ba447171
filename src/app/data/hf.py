"""`data=hf`: a Hugging Face `datasets` data set of images from local files (an optional
extra: `pip install datasets`). Never a download: `path` is a folder on disk, either

- what `save_to_disk` wrote (a DatasetDict or a single Dataset), or
- a folder that `load_dataset` reads by itself: parquet files (`train-*.parquet`, ...) or an
  image folder (`train/CLASS/IMAGE.jpg`, ...); `builder` names the builder when the files do
  not tell it (`parquet`, `imagefolder`).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from PIL import Image

from app.data import transforms
from app.data.base import split
from app.data.images import ImageData, ImageSet
from app.errors import BadImage, UserError, first_line

VAL_SPLITS = ("validation", "valid", "val", "test")  # looked for, in this order


class HFRows(ImageSet):
    """The image column of a `datasets.Dataset` (read undecoded, decoded here by Pillow)."""

    def __init__(self, rows: Any, column: str, labels: list[int], mode: str) -> None:
        super().__init__(labels, mode)
        self.rows, self.column = rows, column

    def load(self, index: int) -> Image.Image:
        value = self.rows[index][self.column]
        name = f"row {index} of column {self.column!r}"
        data, path = (value.get("bytes"), value.get("path")) if isinstance(value, dict) else (
            value if isinstance(value, bytes) else None, value if isinstance(value, str) else None)
        if not data and not path:
            raise BadImage(f"{name} holds no image ({type(value).__name__})")
        return transforms.decode(io.BytesIO(data) if data else Path(path), self.mode,
                                 name=f"{name} ({path or 'bytes'})")

    def subset(self, indices: list[int]) -> HFRows:
        return HFRows(self.rows.select(indices), self.column, [self.labels[i] for i in indices],
                      self.mode)


def _datasets() -> Any:
    # Local files only: a builder name or path that is not on disk must not send datasets to
    # the Hub (read when datasets is imported; a user who set them keeps theirs).
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise UserError("data=hf needs the datasets package: pip install datasets "
                        "(or pip install -e '.[hf]')") from None
    return datasets


def _load(path: Path, builder: str | None) -> Any:
    """A DatasetDict (or a Dataset) from the folder."""
    datasets = _datasets()
    if not path.exists():
        raise UserError(f"data.path={path}: no such file or folder")
    try:
        if builder is not None:
            return datasets.load_dataset(builder, data_dir=str(path))
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return datasets.load_from_disk(str(path))  # (what save_to_disk wrote)
        return datasets.load_dataset(str(path))
    except (FileNotFoundError, ValueError, ConnectionError, RuntimeError,
            datasets.exceptions.DatasetGenerationError) as e:
        raise UserError(f"data.path={path}: not a data set datasets can read "
                        f"({first_line(e)})") from None


class HFImages(ImageData):
    """Images and labels from a local Hugging Face data set (see the module's docstring).

    `image_column` and `label_column` name the columns. `train_split` is the training split;
    `val_split` the validation split (null: the first of validation, valid, val, test that
    exists, else a `val_fraction` share of the training split drawn by `split_seed`). The image
    options are ImageData's.
    """

    def __init__(self, path: str, image_column: str = "image", label_column: str = "label",
                 train_split: str = "train", val_split: str | None = None,
                 val_fraction: float = 0.2, builder: str | None = None, **options) -> None:
        super().__init__(**options)
        self.path = Path(path).expanduser()
        loaded = _load(self.path, builder)
        splits = dict(loaded) if hasattr(loaded, "keys") else {train_split: loaded}
        for key, name in (("train_split", train_split), ("val_split", val_split)):
            if name is not None and name not in splits:
                raise UserError(f"data.{key}={name}: {self.path} has the splits "
                                f"{', '.join(splits)}")
        train = splits[train_split]
        for key, column in (("image_column", image_column), ("label_column", label_column)):
            if column not in train.column_names:
                raise UserError(f"data.{key}={column}: {self.path} has the columns "
                                f"{', '.join(train.column_names)}")
        datasets, feature = _datasets(), train.features[image_column]
        if isinstance(feature, datasets.Image):  # (read undecoded: Pillow decodes it here)
            undecoded = datasets.Image(decode=False)
            splits = {k: v.cast_column(image_column, undecoded) for k, v in splits.items()}
        elif not isinstance(feature, datasets.Value) or feature.dtype not in (
                "binary", "large_binary", "string"):
            raise UserError(f"data.image_column={image_column}: not a column of images "
                            f"({feature})")
        classes, to_label = _classes(train.features[label_column], train[label_column],
                                     label_column)
        if val_split is None:  # the first named like a validation split that has labels
            # (every label -1, the Hub's convention for a test split, or missing: none)
            val_split = next((s for s in VAL_SPLITS if s in splits and not all(
                v is None or v == -1 for v in splits[s][label_column])), None)
        train, val = (None if name is None else HFRows(splits[name], image_column, _labels(
            splits[name][label_column], to_label, name, label_column), self.mode)
            for name in (train_split, val_split))
        self.use(classes, train, val, f"data.path={self.path}", lambda rows: [
            indices.tolist() for indices in split(len(rows), val_fraction, self.split_seed)])


def _labels(values: list[Any], to_label: Any, split_name: str, column: str) -> list[int]:
    labels = []
    for i, value in enumerate(values):
        try:
            label = to_label(value)
        except (KeyError, ValueError, TypeError):
            label = None
        if label is None:
            raise UserError(f"data.label_column={column}: row {i} of split {split_name} has "
                            f"the label {str(value)[:40]!r}, which is none of the training "
                            f"split's classes")
        labels.append(label)
    return labels


def _classes(feature: Any, values: list[Any], column: str) -> tuple[list[str], Any]:
    """The class names and a function from a label value to its index (None: not a class)."""
    names = getattr(feature, "names", None)  # a ClassLabel column
    if names:
        return list(names), lambda value: value if 0 <= value < len(names) else None
    kinds = {type(v) for v in values}
    if not kinds <= {int, str} or not values:
        raise UserError(f"data.label_column={column}: not a column of labels (class indices "
                        f"or names), it holds {', '.join(sorted(k.__name__ for k in kinds))}")
    found = sorted(set(values), key=lambda v: (isinstance(v, str), v))  # 2 before 10
    index = {value: i for i, value in enumerate(found)}
    return [str(v) for v in found], index.get
