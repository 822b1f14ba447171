"""Your own images (`data=image_folder`): found, decoded, augmented from (seed, epoch, index),
normalised by the training images, cached, and used in every mode and callback. In-process
(`run_job`); the folders are made by the tests (tests/helpers/images.py)."""

from __future__ import annotations

import csv
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from app.data import ImageFolder, transforms
from app.errors import DataItemError, UserError
from conftest import HELPERS, REPO, assert_same_weights, load_state, read_metrics, run_job

sys.path.insert(0, str(HELPERS))
from images import CLASSES, corrupt, make_image_folder  # noqa: E402

# 36 images of 3 classes: 29 for training, 7 for validation; 3 steps an epoch.
SMALL = ["model=resnet", "model.channels=[8,16]", "data.image_size=16", "data.batch_size=8",
         "trainer.max_epochs=4", "trainer.log_every_n_steps=1", "trainer.progress_bar=false"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("images") / "shapes"
    make_image_folder(root)
    return root


def _data(root, **options) -> ImageFolder:
    data = ImageFolder(root=str(root), **{"image_size": 16, **options})
    if data.cache:  # (what build_data does before training: the cache, the normalisation)
        data.cache_in_memory()
    data.prepare()
    return data


def test_the_folder_gives_classes_splits_and_shapes(folder) -> None:
    data = _data(folder, channels=1)
    assert data.classes == list(CLASSES) and data.num_classes == 3
    assert (len(data.train), len(data.val)) == (29, 7)  # about 0.2 of 36, by each file's hash
    assert data.input_shape == (1, 16, 16)
    x, y = data.val[0]
    assert x.shape == (1, 16, 16) and x.dtype == torch.float32 and 0 <= int(y) < 3
    other = _data(folder, split_seed=1)
    assert other.val.files != data.val.files  # the split follows split_seed
    assert _data(folder).val.files == data.val.files  # and nothing else


def test_the_normalisation_comes_from_the_training_images(folder) -> None:
    data = _data(folder, augment=False)
    views = torch.stack([data.train[i][0] for i in range(len(data.train))])
    assert views.mean((0, 2, 3)).abs().max() < 1e-4  # centred...
    assert (views.std((0, 2, 3)) - 1).abs().max() < 1e-2  # ...and scaled, per channel
    given = _data(folder, mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25])
    assert given.stats.tolist() == [[0.5] * 3, [0.25] * 3]
    x = given.val[0][0]
    assert torch.allclose(given.show(x) * 1, ((x * 0.25) + 0.5).clamp(0, 1))


def test_under_ddp_one_rank_reads_the_images_for_the_normalisation(folder, monkeypatch) -> None:
    """The other ranks receive rank 0's values (the same: the sample is drawn by the seed)
    instead of decoding the sample again."""
    from app import dist
    from app.data import images

    reference = _data(folder).stats.clone()
    computed = []
    real = images._statistics
    monkeypatch.setattr(images, "_statistics", lambda *a: computed.append(1) or real(*a))
    monkeypatch.setattr(dist, "broadcast_object", lambda obj, src=0: reference.clone())
    monkeypatch.setattr(dist, "is_main", lambda local=False: False)  # (rank 1)
    assert torch.equal(_data(folder).stats, reference) and computed == []
    monkeypatch.setattr(dist, "is_main", lambda local=False: True)  # (rank 0)
    assert torch.equal(_data(folder).stats, reference) and computed == [1]


def test_augmentation_depends_on_seed_epoch_and_index_only(folder) -> None:
    a, b = _data(folder), _data(folder)
    a.set_epoch(1, seed=7)
    b.set_epoch(1, seed=7)
    assert torch.equal(a.train[5][0], b.train[5][0])  # another process, the same crop
    first = a.train[5][0]
    a.set_epoch(2, seed=7)
    assert not torch.equal(a.train[5][0], first)  # another epoch, another crop
    a.set_epoch(1, seed=8)
    assert not torch.equal(a.train[5][0], first)  # another seed too
    assert torch.equal(a.val[2][0], b.val[2][0])  # validation is never augmented


def test_the_cache_gives_exactly_the_same_samples(folder) -> None:
    plain, cached = _data(folder), _data(folder, cache=True)
    assert cached.train.decoded is not None and cached.train.decoded.pixels.is_shared()
    for data in (plain, cached):
        data.set_epoch(3, seed=0)
    for i in range(len(plain.train)):
        assert torch.equal(plain.train[i][0], cached.train[i][0])
    assert torch.equal(plain.stats, cached.stats)


@pytest.mark.parametrize("val_name", ["val", "valid", "validation", "test"])
def test_a_layout_with_train_and_val_folders(tmp_path, val_name) -> None:
    make_image_folder(tmp_path / "train", per_class=4)
    make_image_folder(tmp_path / val_name, per_class=2, seed=1, classes=CLASSES[1:])
    data = _data(tmp_path)
    assert data.classes == list(CLASSES) and (len(data.train), len(data.val)) == (12, 4)
    assert sorted(set(data.val.labels)) == [1, 2]  # labelled by train/'s classes


def test_a_train_folder_alone_gives_its_classes_and_a_drawn_share(tmp_path) -> None:
    make_image_folder(tmp_path / "train", per_class=5)
    data = _data(tmp_path)
    assert data.classes == list(CLASSES) and (len(data.train), len(data.val)) == (12, 3)


def test_adding_images_moves_none_of_the_others_between_the_splits(tmp_path) -> None:
    make_image_folder(tmp_path / "shapes", per_class=20)
    before = _data(tmp_path / "shapes")
    make_image_folder(tmp_path / "more", per_class=2, seed=5)
    for kind in CLASSES:  # two new images in each class
        for path in (tmp_path / "more" / kind).iterdir():
            shutil.copy(path, tmp_path / "shapes" / kind / f"new-{path.name}")
    after = _data(tmp_path / "shapes")
    old_val, new_val = set(before.val.files), set(after.val.files)
    assert old_val <= new_val and all("new-" in f.name for f in new_val - old_val)
    assert set(before.train.files) <= set(after.train.files)


def test_images_are_decoded_as_a_viewer_shows_them(tmp_path) -> None:
    deep = (np.arange(32 * 32).reshape(32, 32) * 64).astype(np.uint16)  # 16 bits: 0 to 65472
    Image.fromarray(deep).save(tmp_path / "deep.png")
    grey = np.asarray(transforms.decode(tmp_path / "deep.png", "L"), dtype=np.float64)
    assert grey.min() == 0 and grey.max() >= 254 and 120 < grey.mean() < 135  # not all white
    photo = Image.new("RGB", (60, 20), (200, 0, 0))
    exif = photo.getexif()
    exif[0x0112] = 6  # a camera held upright: rotate 90 degrees to show it
    photo.save(tmp_path / "upright.jpg", exif=exif)
    assert transforms.decode(tmp_path / "upright.jpg", "RGB").size == (20, 60)
    # Transparent pixels show on white (what lies under them here is black), half-transparent
    # ones blend: RGBA, grey with alpha, and a palette image with a transparent colour.
    logo = np.zeros((4, 4, 4), dtype=np.uint8)
    logo[0, 0] = [255, 0, 0, 255]
    logo[0, 1] = [0, 0, 0, 128]
    Image.fromarray(logo, "RGBA").save(tmp_path / "logo.png")
    Image.fromarray(logo, "RGBA").convert("LA").save(tmp_path / "grey-logo.png")
    Image.fromarray(logo[..., :3], "RGB").convert("P").save(tmp_path / "palette.png",
                                                            transparency=0)
    rgb = np.asarray(transforms.decode(tmp_path / "logo.png", "RGB"))
    assert rgb[0, 0].tolist() == [255, 0, 0] and rgb[3, 3].tolist() == [255, 255, 255]
    assert 120 <= rgb[0, 1, 0] <= 130  # half black over white
    assert np.asarray(transforms.decode(tmp_path / "grey-logo.png", "L"))[3, 3] == 255
    assert np.asarray(transforms.decode(tmp_path / "palette.png", "RGB"))[3, 3].tolist() == \
        [255, 255, 255]
    strip = Image.new("RGB", (20000, 1), (10, 200, 30))  # cut out before it is resized
    view = transforms.resize_and_crop(strip, (64, 64))
    assert view.size == (64, 64) and np.asarray(view)[0, 0].tolist() == [10, 200, 30]


@pytest.mark.parametrize(("make", "words"), [
    (lambda root: None, "no such folder"),
    (lambda root: make_image_folder(root, per_class=2, classes=("one",)), "a classifier needs two"),
    (lambda root: (make_image_folder(root, per_class=2), (root / "empty").mkdir()),
     "empty holds no images"),
    (lambda root: (make_image_folder(root / "train", per_class=2),
                   make_image_folder(root / "val", per_class=1, classes=("circle", "cat"))),
     "val/ has classes that train/ has not: cat"),
], ids=["missing", "one-class", "empty-class", "unknown-val-class"])
def test_a_folder_that_cannot_work_is_one_line_naming_it(tmp_path, make, words) -> None:
    make(tmp_path / "root")
    with pytest.raises(UserError, match=words) as raised:
        _data(tmp_path / "root")
    assert "\n" not in str(raised.value)


def test_linked_folders_are_followed_once_and_a_loop_is_named(tmp_path) -> None:
    root = tmp_path / "shapes"
    make_image_folder(root)
    first = CLASSES[0]
    # A linked folder of another place is followed, and two links to it count its images once.
    make_image_folder(tmp_path / "more", per_class=2, classes=(first,))
    (root / first / "more").symlink_to(tmp_path / "more" / first)
    (root / first / "again").symlink_to(tmp_path / "more" / first)
    data = _data(root)
    assert len(data.train) + len(data.val) == 36 + 2
    # A link back to the root: every image again under this class, over and over, before.
    (root / first / "loop").symlink_to(root)
    with pytest.raises(UserError, match=f"{first}/loop links to .*a loop; remove the link"):
        _data(root)


def test_a_path_with_a_space_and_a_non_ascii_letter_works_quoted_as_documented(tmp_path) -> None:
    """docs/data.md's command, Hydra's quotes inside the shell's, on such a folder. Unquoted,
    Hydra's grammar refuses the `ö`."""
    from app.compose_errors import compose_error

    [command] = [line for line in (REPO / "docs" / "data.md").read_text().splitlines()
                 if line.startswith("python -m app") and "'data.root=\"" in line]
    # (as the shell passes them; the page's folder is relative to where it runs)
    words = shlex.split(command.replace('"Fotos 2024/', f'"{tmp_path}/Fotos 2024/'))
    root = tmp_path / "Fotos 2024" / "Größe"
    assert f'data.root="{root}"' in words
    make_image_folder(root, per_class=4)
    assert compose_error(["data=image_folder", f"data.root={root}"]) is not None
    job = run_job(tmp_path / "run", *words[words.index("app") + 1:], *SMALL,
                  "trainer.max_steps=1")
    assert f"data.root={root}: 3 classes" in job.output, job.output


def test_bad_options_are_named(folder) -> None:
    for options, words in (({"channels": 2}, "data.channels=2"),
                           ({"image_size": [8, 8, 8]}, "data.image_size"),
                           ({"crop_scale": [0.5, 0.2]}, "data.crop_scale"),
                           ({"mean": [0.5]}, "give both"),
                           ({"mean": [0.5], "std": [1.0]}, "3 finite number(s) (one per channel)"),
                           ({"mean": [0.5, float("nan"), 0.5], "std": [1, 1, 1]}, "data.mean"),
                           ({"augment": "off"}, "data.augment=off: expected true or false"),
                           ({"flip": 1}, "data.flip=1: expected true or false"),
                           ({"channels": True}, "data.channels=True"),
                           ({"crop_scale": 0.5}, "data.crop_scale=0.5: expected a list"),
                           ({"root": ""}, "data.root=: give the folder"),
                           ({"val_fraction": "abc"}, "data.val_fraction=abc: expected a number"),
                           ({"bad_files": "ignore"}, "data.bad_files=ignore")):
        with pytest.raises(UserError, match=re.escape(words)):
            ImageFolder(**{"root": str(folder), "image_size": 16, **options})


def test_an_unreadable_image_stops_the_run_naming_it_or_is_skipped_and_counted(tmp_path) -> None:
    root = tmp_path / "shapes"
    make_image_folder(root)
    bad = corrupt(root / "square" / "zz-broken.jpg")
    # Met while the normalisation is computed (a training image) or while loading (either).
    with pytest.raises((UserError, DataItemError),
                       match=f"{bad} is not a readable image.*data.bad_files=skip"):
        run_job(tmp_path / "fails", "data=image_folder", f"data.root={root}", *SMALL)
    job = run_job(tmp_path / "skips", "data=image_folder", f"data.root={root}", *SMALL,
                  "data.bad_files=skip", "trainer.max_epochs=1")
    assert "1 unreadable image(s) left out; the first: " + str(bad) in job.output
    assert "29 training and 7 validation images" in job.output  # 37 files, 36 images


def test_a_bad_image_met_while_training_names_its_file(tmp_path) -> None:
    # With the normalisation given, no image is read before training: the loader meets it.
    root = tmp_path / "shapes"
    make_image_folder(root)
    for path in (root / "circle").iterdir():
        corrupt(path)
    with pytest.raises(Exception, match=r"item \d+ failed to load: BadImage: .*circle.* is not a "
                                        r"readable image"):
        run_job(tmp_path / "run", "data=image_folder", f"data.root={root}", *SMALL,
                "data.mean=[0.2,0.2,0.2]", "data.std=[0.3,0.3,0.3]")


@pytest.fixture(scope="module")
def trained(folder, tmp_path_factory):
    """A run on the folder with augmentation, 2 loader workers and a checkpoint every 2 steps
    (12 steps in all), with eval_visuals."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    return run_job(run_dir, "data=image_folder", f"data.root={folder}", *SMALL,
                   "data.num_workers=2", "trainer.ckpt_every_n_steps=2", "trainer.keep_last=100",
                   "+callbacks/eval_visuals=default").run_dir


def test_resume_is_exact_with_augmentation_and_two_loader_workers(folder, trained,
                                                                  tmp_path) -> None:
    source = trained / "checkpoints" / "step-00000004.pt"  # mid-epoch 2
    resumed = run_job(tmp_path / "resumed", "data=image_folder", f"data.root={folder}", *SMALL,
                      "data.num_workers=2", "trainer.ckpt_every_n_steps=2",
                      "trainer.keep_last=100", "+callbacks/eval_visuals=default",
                      f"resume={source}")
    assert "resumed from" in resumed.output
    assert_same_weights(trained / "checkpoints" / "last.pt",
                        resumed.run_dir / "checkpoints" / "last.pt")
    after = [r for r in read_metrics(trained) if int(r["step"]) > 4]
    assert after and [r for r in read_metrics(resumed.run_dir) if int(r["step"]) > 4] == after


def test_the_checkpoint_keeps_the_classes_and_the_normalisation(folder, trained) -> None:
    state = load_state(trained / "checkpoints" / "last.pt")["data"]
    data = _data(folder)
    assert state == {"classes": list(CLASSES), "input_shape": [3, 16, 16],
                     "mean": data.stats[0].tolist(), "std": data.stats[1].tolist()}


def _rows(run_dir) -> list[dict[str, str]]:
    with open(run_dir / "predictions.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_every_mode_reads_the_folder_as_training_did(folder, trained, tmp_path) -> None:
    best = trained / "checkpoints" / "best.pt"
    recorded = load_state(best)["metrics"]["acc"]
    common = ["data=image_folder", f"data.root={folder}", *SMALL, f"ckpt={best}"]
    # Another normalisation on the command line: the checkpoint's is the one used.
    other = ["data.mean=[0,0,0]", "data.std=[1,1,1]"]
    assert run_job(tmp_path / "eval", *common, *other, "trainer=eval").value == recorded
    predicted = run_job(tmp_path / "predict", *common, "trainer=predict")
    assert predicted.value == recorded
    # The validation images as a folder of their own: predicted exactly as in the split.
    files = tmp_path / "files"
    files.mkdir()
    for i, path in enumerate(_data(folder).val.files):
        shutil.copy(path, files / f"{i:02d}{path.suffix}")
    from_files = run_job(tmp_path / "files-run", *common, "trainer=predict",
                         f"predict.input={files}")
    by_split, by_file = (_rows(job.run_dir) for job in (predicted, from_files))
    assert [r["pred"] for r in by_file] == [r["pred"] for r in by_split]
    assert [r["confidence"] for r in by_file] == [r["confidence"] for r in by_split]
    assert [Path(r["input"]).stem for r in by_file] == [f"{i:02d}" for i in range(7)]
    assert {r["pred_class"] for r in by_file} <= set(CLASSES) and by_file[0]["label_class"] == ""
    assert by_split[0]["label_class"] == CLASSES[int(by_split[0]["label"])]
    assert by_split[0]["input"] == str(_data(folder).val.files[0])  # the file, not val[0]
    exported = run_job(tmp_path / "export", *common, "trainer=export")
    check = json.loads((exported.run_dir / "export" / "check.json").read_text())
    assert max(check["max_abs_diff"].values()) <= check["tolerance"]
    meta = json.loads((exported.run_dir / "export" / "model.json").read_text())
    assert meta["classes"] == list(CLASSES) and meta["input_shape"] == [3, 16, 16]
    assert meta["data"]["mean"] == load_state(best)["data"]["mean"]  # to preprocess inputs
    # One image, named; a hidden file in a folder is left out, as training does.
    first = next(files.glob("00.*"))
    one = run_job(tmp_path / "one", *common, "trainer=predict", f"predict.input={first}")
    assert _rows(one.run_dir)[0]["pred"] == by_split[0]["pred"]
    corrupt(files / ".hidden.png")
    assert len(_rows(run_job(tmp_path / "hidden", *common, "trainer=predict",
                             f"predict.input={files}").run_dir)) == 7
    for picture in (predicted.run_dir / "predictions.png",
                    trained / "eval_visuals" / "step-00000012.png"):
        with Image.open(picture) as image:
            image.verify()  # the whole file decodes
        with Image.open(picture) as image:
            assert any(f"true {name}" in image.text["Description"] for name in CLASSES)


def test_a_checkpoint_of_other_classes_or_image_size_is_refused(folder, trained,
                                                                 tmp_path) -> None:
    renamed, fewer = tmp_path / "renamed", tmp_path / "fewer"
    shutil.copytree(folder, renamed)
    (renamed / "stripes").rename(renamed / "zebra")
    shutil.copytree(folder, fewer)
    shutil.rmtree(fewer / "stripes")
    ckpt = f"ckpt={trained / 'checkpoints' / 'best.pt'}"
    for root in (renamed, fewer):  # (fewer: the classes are named, not the head's shape)
        with pytest.raises(UserError, match="the checkpoint was trained on circle, square, "
                                            "stripes"):
            run_job(tmp_path / "eval", "data=image_folder", f"data.root={root}", *SMALL,
                    "trainer=eval", ckpt)
    with pytest.raises(UserError, match=re.escape(
            "trained on 3x16x16 images, the data gives 3x24x24: use data.channels=3 "
            "data.image_size=[16,16]")):
        run_job(tmp_path / "export", "data=image_folder", f"data.root={folder}", *SMALL,
                "data.image_size=24", "trainer=export", ckpt)


def test_two_devices_train_on_the_folder(folder, tmp_path) -> None:
    job = run_job(tmp_path / "ddp", "data=image_folder", f"data.root={folder}", *SMALL,
                  "devices=2", "data.batch_size=4", "trainer.max_epochs=2")
    assert load_state(job.run_dir / "checkpoints" / "last.pt")["loop"]["step"] == 6
    assert "x 2: 3 steps/epoch" in (job.run_dir / "logs" / "rank0.log").read_text()


def test_a_users_data_config_states_only_what_differs(folder, tmp_path) -> None:
    # The loader keys come from config.LoaderConfig: overriding one needs no `+`.
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "mine.yaml").write_text(
        f"_target_: app.data.ImageFolder\nroot: {folder}\nimage_size: 16\n")
    job = run_job(tmp_path / "run", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
                  "data=mine", "data.cache=true", "data.batch_size=8", *SMALL[:2],
                  "trainer.max_epochs=1", "trainer.progress_bar=false")
    assert "cached 29 + 7 decoded images in shared memory" in job.output
    with pytest.raises(UserError, match="data.num_workers=-1: expected a whole number >= 0"):
        run_job(tmp_path / "bad", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
                "data=mine", "data.num_workers=-1")


def test_any_map_style_dataset_works_in_every_mode(tmp_path) -> None:
    # tests/helpers/user_data.py: Python lists behind a Dataset, normalised by the user.
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "lists.yaml").write_text("_target_: user_data.ListDigits\n")
    user = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "data=lists", "model.channels=[8,16]",
            "trainer.max_epochs=2", "trainer.progress_bar=false"]
    trained = run_job(tmp_path / "train", *user, "+callbacks/eval_visuals=default",
                      user_code=HELPERS).run_dir
    best = trained / "checkpoints" / "best.pt"
    recorded = load_state(best)["metrics"]["acc"]
    ckpt = [*user, f"ckpt={best}"]
    assert run_job(tmp_path / "eval", *ckpt, "trainer=eval", user_code=HELPERS).value == recorded
    predicted = run_job(tmp_path / "predict", *ckpt, "trainer=predict", user_code=HELPERS)
    assert predicted.value == recorded and len(_rows(predicted.run_dir)) == 100
    assert run_job(tmp_path / "export", *ckpt, "trainer=export", user_code=HELPERS).value <= 1e-5
    with Image.open(trained / "eval_visuals" / "step-00000014.png") as image:
        assert image.text["Description"].startswith("pred ")
