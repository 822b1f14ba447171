"""`data=image_folder`: your own images, one sub-folder per class (the ImageFolder layout).

    ROOT/CLASS/IMAGE.jpg                          a validation share drawn by split_seed
    ROOT/train/CLASS/...  and  ROOT/val/CLASS/... or the split you made
"""

from __future__ import annotations

import logging
from pathlib import Path

from PIL import Image

from app.data import transforms
from app.data.base import IMAGE_SUFFIXES, split
from app.data.images import ImageData, ImageSet
from app.errors import BadImage, UserError

log = logging.getLogger(__name__)

BAD_FILES = ("fail", "skip")
Files = tuple[list[Path], list[int]]


class FolderImages(ImageSet):
    """Image files, decoded when read; an unreadable one raises BadImage naming it."""

    def __init__(self, files: list[Path], labels: list[int], mode: str) -> None:
        super().__init__(labels, mode)
        self.files = files

    def load(self, index: int) -> Image.Image:
        return transforms.decode(self.files[index], self.mode)


class ImageFolder(ImageData):
    """The images under `root`, one sub-folder per class (see the module's docstring).

    `val_fraction` and `split_seed` draw the validation share when `root` has no `train/` and
    `val/` folders. `bad_files`: `fail` (an unreadable image stops the run, naming the file)
    or `skip` (every image is decoded once at the start; unreadable ones are left out and
    counted). The image options are ImageData's.
    """

    def __init__(self, root: str, val_fraction: float = 0.2, bad_files: str = "fail",
                 **options) -> None:
        super().__init__(**options)
        if bad_files not in BAD_FILES:
            raise UserError(f"data.bad_files={bad_files}: one of {', '.join(BAD_FILES)}")
        self.root = Path(root).expanduser()
        classes, train, val = _find(self.root, val_fraction, self.split_seed)
        if bad_files == "skip":
            train, val = _readable(train, self.mode), _readable(val, self.mode)
        self.use(classes, FolderImages(*train, self.mode), FolderImages(*val, self.mode),
                 f"data.root={self.root}")


def _class_folders(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES
                  and p.is_file() and not p.name.startswith("."))


def _labelled(folder: Path, classes: list[str], labels_of: list[str]) -> Files:
    """The images of each class folder of `folder`, labelled by the class's place in
    `labels_of`."""
    files, labels = [], []
    for name in classes:
        found = _images(folder / name)
        if not found:
            raise UserError(f"data.root: the class folder {folder / name} holds no images "
                            f"({', '.join(IMAGE_SUFFIXES)})")
        files += found
        labels += [labels_of.index(name)] * len(found)
    return files, labels


def _find(root: Path, val_fraction: float, split_seed: int) -> tuple[list[str], Files, Files]:
    """The classes, and the (files, labels) of training and of validation."""
    if not root.is_dir():
        raise UserError(f"data.root={root}: no such folder (one sub-folder per class, each "
                        f"holding its images)")
    if (root / "train").is_dir() and (root / "val").is_dir():
        classes = _class_folders(root / "train")
        _enough(root / "train", classes)
        val_classes = _class_folders(root / "val")
        extra = sorted(set(val_classes) - set(classes))
        if extra:
            raise UserError(f"data.root={root}: val/ has classes that train/ has not: "
                            f"{', '.join(extra)}")
        return (classes, _labelled(root / "train", classes, classes),
                _labelled(root / "val", val_classes, classes))
    classes = _class_folders(root)
    _enough(root, classes)
    files, labels = _labelled(root, classes, classes)
    train_idx, val_idx = split(len(files), val_fraction, split_seed)
    return (classes, ([files[i] for i in train_idx], [labels[i] for i in train_idx]),
            ([files[i] for i in val_idx], [labels[i] for i in val_idx]))


def _enough(folder: Path, classes: list[str]) -> None:
    if len(classes) < 2:
        raise UserError(f"data.root={folder}: {len(classes)} class folder(s) "
                        f"({', '.join(classes) or 'none'}); a classifier needs two or more, "
                        f"each a sub-folder holding its images")


def _readable(files: Files, mode: str) -> Files:
    """`bad_files=skip`: the files that decode; the others are counted in a warning."""
    kept: Files = ([], [])
    bad = []
    for path, label in zip(*files, strict=True):
        try:
            transforms.decode(path, mode)
        except BadImage as e:
            bad.append(str(e))
            continue
        kept[0].append(path)
        kept[1].append(label)
    if bad:
        log.warning("data.bad_files=skip: %d unreadable image(s) left out; the first: %s",
                    len(bad), bad[0])
    if not kept[0]:
        raise UserError(f"data.root: none of the {len(files[0])} images of a split is "
                        f"readable; the first: {bad[0]}")
    return kept
