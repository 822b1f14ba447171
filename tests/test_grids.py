"""The grid of predictions (predictions.png, eval_visuals/): each image, whole, under its
labels; valid PNGs of the size the number of images gives."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from app.reporting.grids import CELL, GREEN, LABEL_H, LINE_H, RED, TITLE_H, save_grid


def _open(path) -> Image.Image:
    with Image.open(path) as image:
        image.verify()  # the whole file decodes
    return Image.open(path)


def _cell(image: Image.Image, i: int, cols: int) -> np.ndarray:
    left, top = (i % cols) * CELL[0], TITLE_H + (i // cols) * CELL[1]
    return np.asarray(image.convert("RGB").crop((left, top, left + CELL[0], top + CELL[1])))


def _has(cell: np.ndarray, color: tuple[int, int, int]) -> bool:
    return bool((cell == color).all(axis=-1).any())


def test_a_grid_shows_each_digit_whole_under_its_labels(tmp_path) -> None:
    images = torch.zeros(10, 1, 8, 8)
    images[:, 0, 2:6, 3] = 1.0  # a bar one pixel wide, four high: drawn as it is, white on black
    labels = [1] * 9 + [2]
    path = tmp_path / "grid.png"
    save_grid(images, [1] * 10, labels, "step 5: 9/10 right", path)
    image = _open(path)
    assert image.size == (8 * CELL[0], 2 * CELL[1] + TITLE_H)  # 8 a row, 2 rows
    assert image.text["Title"] == "step 5: 9/10 right"
    assert image.text["Description"].split("; ") == ["pred 1 / true 1"] * 9 + ["pred 1 / true 2"]
    right, wrong = _cell(image, 0, 8), _cell(image, 9, 8)
    assert _has(right[:LABEL_H], GREEN) and not _has(right[:LABEL_H], RED)
    assert _has(wrong[:LABEL_H], RED) and not _has(wrong[:LABEL_H], GREEN)
    black = np.argwhere((right[LABEL_H:] == 0).all(axis=-1))  # the image's ground (value 0)
    (top, left), (bottom, end) = black.min(0), black.max(0)
    shown = right[LABEL_H:][top:bottom + 1, left:end + 1]
    assert shown.shape[0] == shown.shape[1] >= 64  # the whole 8x8 image, scaled up
    bar = np.argwhere((shown == 255).all(axis=-1))  # value 1: white
    height, width = bar.max(0) - bar.min(0) + 1
    assert height == 4 * width and width >= 8  # scaled by whole pixels, not smoothed
    assert ((shown == 0) | (shown == 255)).all()  # black or white only


def test_a_colour_grid_keeps_its_colours_and_its_size(tmp_path) -> None:
    images = torch.zeros(3, 3, 4, 4)
    images[:, 2] = 1.0  # blue
    path = tmp_path / "grid.png"
    save_grid(images, [0, 1, 2], None, "colour", path)
    image = _open(path)
    assert image.size == (3 * CELL[0], CELL[1] + TITLE_H)
    assert image.text["Description"] == "pred 0; pred 1; pred 2"
    assert _has(_cell(image, 2, 3), (0, 0, 255))


def test_inputs_that_are_not_pictures_still_make_a_grid(tmp_path) -> None:
    # A user's data of 2 channels, or a feature vector: Pillow refused them ("Invalid mode"),
    # and trainer=predict or the eval_visuals callback failed after their real work.
    for shape in [(4, 2, 6, 6), (4, 10), (4, 5, 7, 7)]:
        images = torch.rand(shape)
        images[0] = float("nan")  # (NaN inputs draw as black, not as an error)
        path = tmp_path / f"grid-{len(shape)}-{shape[1]}.png"
        save_grid(images, [0, 1, 2, 3], [0, 1, 1, 3], "odd inputs", path)
        assert _open(path).text["Description"].count("pred") == 4


def test_class_names_label_the_cells_and_a_long_one_stays_in_its_cell(tmp_path) -> None:
    classes = ["a_class_name_far_too_long_for_one_cell_of_the_grid", "b"]
    path = tmp_path / "grid.png"
    save_grid(torch.rand(2, 3, 4, 4), [0, 1], [0, 0], "names", path, classes=classes)
    image = _open(path)
    assert image.text["Description"] == f"pred {classes[0]} / true {classes[0]}; " \
                                        f"pred b / true {classes[0]}"  # whole, for tools
    band = np.asarray(image.convert("RGB"))[TITLE_H:TITLE_H + LABEL_H]
    inked = np.argwhere((band != 255).any(axis=-1))[:, 1]
    first = inked[inked < CELL[0]]
    assert first.min() > 0 and first.max() < CELL[0] - 1  # the label ends inside its cell


def _drawn_labels(monkeypatch) -> list[tuple[str, object, tuple[int, int, int, int]]]:
    """The (text, font, box drawn in) of every line the grid draws, its title's first."""
    from PIL import ImageDraw

    drawn, real = [], ImageDraw.ImageDraw.text

    def text(self, xy, content, *args, **kwargs):
        box = self.textbbox(xy, content, font=kwargs.get("font"), anchor=kwargs.get("anchor"))
        drawn.append((content, kwargs.get("font"), box))
        return real(self, xy, content, *args, **kwargs)

    monkeypatch.setattr(ImageDraw.ImageDraw, "text", text)
    return drawn


def test_names_beyond_ascii_are_drawn_with_a_font_that_has_them_or_as_indices(
        tmp_path, monkeypatch) -> None:
    """Pillow's own font has ASCII only: "café" showed as "caf" and a box."""
    from app.reporting import grids

    classes = ["café", "Жук"]
    drawn = _drawn_labels(monkeypatch)
    grids._fonts.cache_clear()
    save_grid(torch.rand(2, 3, 4, 4), [0, 1], [0, 1], "t", tmp_path / "a.png", classes=classes)
    labels = drawn[1:]
    system = grids._fonts(12)[1:]  # the fallback fonts this machine has
    if any(grids._draws(f, "".join(classes)) for f in system):
        assert [t for t, *_ in labels] == ["pred café / true café", "pred Жук / true Жук"]
        assert all(grids._draws(font, text) for text, font, _ in labels)
    else:
        print("no system font here draws", classes, "- the grid gives their indices")
        assert [t for t, *_ in labels] == ["pred #0 / true #0", "pred #1 / true #1"]
    # Where no font draws them, the indices, and a file name's "?" (the PNG's text keeps them).
    drawn.clear()
    monkeypatch.setattr(grids, "FALLBACK_FONTS", ())
    grids._fonts.cache_clear()
    try:
        save_grid(torch.rand(1, 3, 4, 4), [1], None, "t", tmp_path / "b.png", classes=classes,
                  names=["жук.png"])
    finally:
        grids._fonts.cache_clear()
    assert [t for t, *_ in drawn[1:]] == ["???.png", "pred #1"]
    assert _open(tmp_path / "b.png").text["Description"] == "жук.png: pred Жук"
    assert grids._draws(grids._fonts(12)[0], "pred 7 / true cat")  # ASCII: Pillow's own font


def test_captions_fit_their_cells_whole_or_shortened_in_the_middle(tmp_path, monkeypatch) -> None:
    """Each caption line lies inside its cell's label band (measured as drawn): labels too
    wide for a line go on two, a long file name loses its middle, not its end (the number
    and suffix that tell it from its neighbours); the PNG's text keeps them whole."""
    names = ["7.png", "IMG_20240517_143502_scan_of_handwritten_digit_from_notebook_page_12.png"]
    classes = ["pickup_truck", "sports_car"]
    drawn = _drawn_labels(monkeypatch)
    for grid, named in (("named", names), ("unnamed", None)):
        drawn.clear()
        save_grid(torch.rand(2, 3, 4, 4), [0, 1], [1, 1], "t", tmp_path / f"{grid}.png",
                  classes=classes, indices=[104, 3], names=named)
        lines = [(text, box) for text, font, box in drawn if font.size < 14]  # (not the title)
        texts = [text for text, _ in lines]
        if named:
            head, tail = texts[3].split("...")
            assert names[1].startswith(head) and names[1].endswith(tail)
            assert len(head) >= 8 and tail.endswith("_12.png")
            assert texts == ["7.png", "#104 pred pickup_truck", "true sports_car",
                             texts[3], "#3 pred sports_car", "true sports_car"]
            band = 3 * LINE_H + 4
        else:
            assert texts == ["#104 pred pickup_truck", "true sports_car",
                             "#3 pred sports_car", "true sports_car"]
            band = LABEL_H
        for i, (_, (left, top, right, bottom)) in enumerate(lines):
            cell = i // (len(lines) // 2)
            assert cell * CELL[0] < left and right < (cell + 1) * CELL[0]
            assert TITLE_H <= top and bottom <= TITLE_H + band
        image = _open(tmp_path / f"{grid}.png")
        assert image.size == (2 * CELL[0], TITLE_H + CELL[1] + band - LABEL_H)
    assert _open(tmp_path / "named.png").text["Description"] == \
        f"7.png: #104 pred pickup_truck / true sports_car; {names[1]}: #3 pred sports_car / " \
        f"true sports_car"


def test_a_title_too_long_for_a_narrow_grid_is_wrapped_whole(tmp_path, monkeypatch) -> None:
    """A grid of one image is 160 pixels wide: a long title (and a checkpoint name wider than
    that) takes more lines, the band above the cells growing for them, and none is cut."""
    drawn = _drawn_labels(monkeypatch)
    title = "epoch=12-step=3400-val_loss=0.1234.ckpt: 1 of 120 inputs, the mistakes first: " \
            "1 of 7 wrong (red); accuracy 94.17%"
    save_grid(torch.rand(1, 1, 8, 8), [0], [1], title, tmp_path / "a.png")
    lines = [(text, box) for text, font, box in drawn if font.size == 14]
    assert len(lines) > 2
    assert "".join(text for text, _ in lines).replace(" ", "") == title.replace(" ", "")
    assert all(0 <= box[0] and box[2] <= CELL[0] for _, box in lines)
    image = _open(tmp_path / "a.png")
    assert image.size == (CELL[0], CELL[1] + TITLE_H + 18 * (len(lines) - 2))
    (_, caption), = [(t, box) for t, font, box in drawn if font.size < 14]
    assert caption[1] > lines[-1][1][3]  # below the title
    assert _has(np.asarray(image.convert("RGB"))[-CELL[1]:][:LABEL_H], RED)
