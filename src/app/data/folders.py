"""`data=image_folder`: your own images, one sub-folder per class (the ImageFolder layout).

    ROOT/CLASS/IMAGE.jpg                          a validation share drawn by split_seed
    ROOT/train/CLASS/...  and  ROOT/val/CLASS/... or the split you made (val/ may also be
                                                  valid/, validation/ or test/)

The drawn share keys on each file's path (a hash with split_seed), not on how many files
there are: adding images to the folder moves none of the others between the splits (so a
resumed run or an evaluation after you added photos never sees a former training image as a
validation one). The share is val_fraction on average, not exactly.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from PIL import Image

from app.data import transforms
from app.data.base import IMAGE_SUFFIXES, is_image_name, split
from app.data.images import ImageData, ImageSet
from app.errors import UserError

VAL_FOLDERS = ("val", "valid", "validation", "test")  # beside train/, looked for in this order
Files = tuple[list[Path], list[int]]


class FolderImages(ImageSet):
    """Image files, decoded when read; an unreadable one raises BadImage naming it."""

    def __init__(self, files: list[Path], labels: list[int], mode: str) -> None:
        super().__init__(labels, mode)
        self.files = files

    def load(self, index: int) -> Image.Image:
        return transforms.decode(self.files[index], self.mode)

    def subset(self, indices: list[int]) -> FolderImages:
        return FolderImages([self.files[i] for i in indices], [self.labels[i] for i in indices],
                            self.mode)


class ImageFolder(ImageData):
    """The images under `root`, one sub-folder per class (see the module's docstring).

    `val_fraction` and `split_seed` draw the validation share when `root` has no `train/` and
    `val/` folders. The image options (`bad_files` too) are ImageData's.
    """

    def __init__(self, root: str, val_fraction: float = 0.2, **options) -> None:
        super().__init__(**options)
        if not isinstance(root, str) or not root.strip():
            raise UserError(f"data.root={root}: give the folder of your images")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, int | float):
            raise UserError(f"data.val_fraction={val_fraction}: expected a number")
        self.root = Path(root).expanduser()
        folder, classes, train, val = _find(self.root)
        self.use(classes, FolderImages(*train, self.mode),
                 None if val is None else FolderImages(*val, self.mode), f"data.root={self.root}",
                 lambda images: split_by_name([str(f.relative_to(folder)) for f in images.files],
                                              val_fraction, self.split_seed))


def _class_folders(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _images(folder: Path) -> list[Path]:
    """The image files under `folder`, in sub-folders too (linked ones followed, each real
    folder once), hidden files and folders left out. A link back to `folder` or above it is
    an error: followed, it would add every image of the data set again under this class,
    over and over, on both sides of the split."""
    found, top = [], os.path.realpath(folder)
    seen = {top}
    for parent, dirs, names in os.walk(folder, followlinks=True):
        kept = []
        for d in (d for d in dirs if not d.startswith(".")):
            real = os.path.realpath(os.path.join(parent, d))
            if real == top or top.startswith(real.rstrip(os.sep) + os.sep):
                raise UserError(f"data.root: {Path(parent, d)} links to {real}, the class "
                                f"folder {folder} or a folder above it: a loop; remove the "
                                f"link")
            if real not in seen:  # (two links to one folder: its images once)
                seen.add(real)
                kept.append(d)
        dirs[:] = kept
        found += [Path(parent, n) for n in names if is_image_name(n)]
    return sorted(found)


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


def _find(root: Path) -> tuple[Path, list[str], Files, Files | None]:
    """The folder of the training images, the classes, and the (files, labels) of training and
    of validation (None: a share of training is drawn)."""
    if not root.is_dir():
        raise UserError(f"data.root={root}: no such folder (one sub-folder per class, each "
                        f"holding its images)")
    train_dir = root / "train" if (root / "train").is_dir() else root
    classes = _class_folders(train_dir)
    if len(classes) < 2:
        raise UserError(f"data.root={train_dir}: {len(classes)} class folder(s) "
                        f"({', '.join(classes) or 'none'}); a classifier needs two or more, "
                        f"each a sub-folder holding its images")
    val_dir = None if train_dir == root else next(  # (a training folder alone: a share drawn)
        (root / n for n in VAL_FOLDERS if (root / n).is_dir()), None)
    val = None
    if val_dir is not None:
        val_classes = _class_folders(val_dir)
        extra = sorted(set(val_classes) - set(classes))
        if extra:
            raise UserError(f"data.root={root}: {val_dir.name}/ has classes that train/ has "
                            f"not: {', '.join(extra)}")
        val = _labelled(val_dir, val_classes, classes)
    return train_dir, classes, _labelled(train_dir, classes, classes), val


def split_by_name(names: list[str], val_fraction: float, split_seed: int
                  ) -> tuple[list[int], list[int]]:
    """Train and validation indices: a name goes to validation when its hash (with
    `split_seed`), read as a fraction, is below `val_fraction`. Its side depends on nothing
    else, so adding files moves none of the others. Where that leaves a split empty (a few
    images), the `val_fraction` share of the smallest hashes goes instead."""
    count = len(split(len(names), val_fraction, split_seed)[1])  # (checked: one in each split)
    keys = [int.from_bytes(hashlib.sha256(f"{split_seed}/{n}".encode()).digest()[:8], "big")
            / 2**64 for n in names]
    val = [i for i, key in enumerate(keys) if key < val_fraction]
    if not 0 < len(val) < len(names):
        val = sorted(sorted(range(len(names)), key=keys.__getitem__)[:count])
    taken = set(val)
    return [i for i in range(len(names)) if i not in taken], val
