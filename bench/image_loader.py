"""Loader throughput of `data=image_folder` against a plain PyTorch DataLoader over the same
folder, with the same decoding and transforms (Pillow, the evaluation view or the random
resized crop and flip, normalisation), as one writes it without the app.

The app's side is the loader the loop builds (`build_train_loader`: its sampler, the
wrapper that names a failing item, the augmentation keyed on (seed, epoch, index)); the
plain side is a Dataset of `(path, label)` that opens each file and applies the same
functions of `app.data.transforms`, with a DataLoader of the same batch size, workers and
shuffling. Samples per second over whole epochs, app and plain alternating.

    python bench/image_loader.py   # prints the table
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import BENCH, Stat, paired_ratio, ratio_range
from torch.utils.data import DataLoader, Dataset

from app.data import ImageFolder, transforms
from app.training.build import build_train_loader

sys.path.insert(0, str(BENCH.parent / "tests" / "helpers"))
from images import make_image_folder  # noqa: E402

SIZE, BATCH, PER_CLASS, EPOCHS = 64, 32, 200, 4  # 600 images of 17 to 47 pixels a side


class PlainImages(Dataset):
    """What one writes without the app: open, convert, crop and flip, normalise."""

    def __init__(self, data: ImageFolder) -> None:
        self.files, self.labels = data.train.files, data.train.labels
        self.mode, self.mean, self.std = data.mode, *data.stats[:, :, None, None].clone()

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = transforms.decode(self.files[index], self.mode)
        image = transforms.random_resized_crop(image, (SIZE, SIZE), (0.35, 1.0), True,
                                               random.Random())
        return (transforms.to_tensor(image) - self.mean) / self.std, self.labels[index]


def _rate(loader: DataLoader, before_epoch) -> float:
    """Samples per second over EPOCHS epochs (the first batch, worker start-up, left out)."""
    count, start = 0, None
    for epoch in range(EPOCHS + 1):
        before_epoch(epoch)
        for x, _ in loader:
            if start is None:
                start = time.perf_counter()  # (after the first batch)
                continue
            count += len(x)
    return count / (time.perf_counter() - start)


def measure(root: Path, workers: int, cache: bool, repeats: int) -> tuple[Stat, Stat]:
    app_rates, plain_rates = [], []
    for _ in range(repeats):
        data = ImageFolder(root=str(root), image_size=SIZE, batch_size=BATCH,
                           num_workers=workers, cache=cache)
        loader, sampler = build_train_loader(data, seed=0)
        app_rates.append(_rate(loader, lambda e, d=data, s=sampler: (d.set_epoch(e, 0),
                                                                     s.set_epoch(e))))
        del loader
        plain = DataLoader(PlainImages(data), batch_size=BATCH, shuffle=True, drop_last=True,
                           num_workers=workers, persistent_workers=workers > 0)
        plain_rates.append(_rate(plain, lambda e: None))
        del plain
    return Stat(app_rates), Stat(plain_rates)


def section(repeats: int) -> str:
    rows = []
    with tempfile.TemporaryDirectory(prefix="app-bench-images-") as tmp:
        root = Path(tmp) / "images"
        make_image_folder(root, per_class=PER_CLASS)
        for workers in (0, 2):
            for cache in (False, True):
                app, plain = measure(root, workers, cache, max(5, repeats))  # (cheap)
                ratio = paired_ratio(app, plain)  # rates: higher is better
                verdict = "met" if ratio >= 0.95 else "**missed**"
                rows.append(f"| {workers} | {'on' if cache else 'off'} | {plain.fmt(digits=0)} | "
                            f"{app.fmt(digits=0)} | {ratio_range(app, plain)} | {verdict} |")
    return (f"{3 * PER_CLASS} images (PNG and JPEG, grey, RGB and palette, 17 to 47 pixels a "
            f"side), viewed at {SIZE}x{SIZE} with the training augmentation, batch {BATCH}; "
            f"samples per second over {EPOCHS} epochs.\n\n"
            "| loader workers | app cache | plain DataLoader samples/s | app samples/s | "
            "app / plain | target >= 0.95 |\n|---|---|---|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    print(section(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
