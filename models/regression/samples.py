"""Calibration and held-out samples for the real models, made from real photos.

The pictures are scikit-learn's sample photos and those scikit-image ships (faces among them, and
100 face crops from Labeled Faces in the Wild). Each model gets pictures of the kind it is used
on (a *scene*): varied crops, scales, flips and lighting of the photos; text lines, captchas and
pages rendered with Pillow's default font over photo crops for the text models; faces cropped or
pasted into scenes for the face models. The pictures then go through the model's own
preprocessing (:class:`~models.regression.catalog.Preprocessing`) and are saved one ``.npy`` per
sample, as ``edge-agent build --calib-dir`` reads them.

Everything is seeded from the model's name, so the same sets come out on every run.
"""

from __future__ import annotations

import math
import string
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.regression.catalog import ModelEntry, Preprocessing

__all__ = ["SCENES", "Sources", "load_sources", "make_samples", "preprocess", "write_samples"]

# Face boxes (left, top, right, bottom) in scikit-image's astronaut.png and camera.png.
FACE_BOXES = {"astronaut": (168, 50, 280, 185), "camera": (160, 70, 262, 200)}
_LFW_FACES = 100  # lfw_subset.npy holds 100 faces, then 100 non-faces
_TEXT_CHARS = string.ascii_letters + string.digits
_WORD_CHARS = string.ascii_lowercase + string.digits


@dataclass(frozen=True)
class Sources:
    """The pictures samples are made from (Pillow images, RGB).

    Attributes:
        photos: Scenes of any kind.
        portraits: Photos with one face, and the face's box in each.
        faces: Tight face crops (LFW).
        documents: Scans of printed text.
    """

    photos: list[Any]
    portraits: list[tuple[Any, tuple[int, int, int, int]]]
    faces: list[Any]
    documents: list[Any]


def load_sources(data_files: dict[str, Path]) -> Sources:
    """The pictures from scikit-learn's sample images and the fetched data files (by the names
    of :data:`~models.regression.catalog.DATA_FILES`)."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    def picture(name: str) -> Any:
        with Image.open(data_files[name]) as image:
            return image.convert("RGB")

    photos = [Image.fromarray(array) for array in load_sample_images().images]
    photos += [picture(name) for name in ("astronaut", "camera", "coffee", "chelsea", "rocket",
                                          "motorcycle")]
    portraits = [(picture(name), box) for name, box in FACE_BOXES.items()]
    lfw = np.load(data_files["lfw_subset"], allow_pickle=False)[:_LFW_FACES]
    faces = [Image.fromarray(np.round(face * 255).astype(np.uint8)).convert("RGB") for face in lfw]
    documents = [picture("page"), picture("text")]
    return Sources(photos, portraits, faces, documents)


# --------------------------------------------------------------------------------------------------
# Scenes: each makes one picture (RGB, any size) for a model whose input is ``size`` (h, w).

Scene = Callable[[np.random.Generator, Sources, tuple[int, int]], Any]


def _pick(rng: np.random.Generator, items: list[Any]) -> Any:
    return items[int(rng.integers(len(items)))]


def _crop(rng: np.random.Generator, image: Any, aspect: float, min_fraction: float = 0.35) -> Any:
    """A random crop of ``image`` with width / height ``aspect``, between ``min_fraction`` and
    all of the largest such crop, flipped half the time."""
    from PIL import Image

    width, height = image.size
    crop_w = min(width, height * aspect)
    crop_h = crop_w / aspect
    fraction = rng.uniform(min_fraction, 1.0)
    crop_w, crop_h = max(8, int(crop_w * fraction)), max(8, int(crop_h * fraction))
    left = int(rng.integers(0, width - crop_w + 1))
    top = int(rng.integers(0, height - crop_h + 1))
    crop = image.crop((left, top, left + crop_w, top + crop_h))
    return crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else crop


def _lighting(rng: np.random.Generator, image: Any) -> Any:
    from PIL import ImageEnhance

    image = ImageEnhance.Brightness(image).enhance(rng.uniform(0.7, 1.3))
    return ImageEnhance.Contrast(image).enhance(rng.uniform(0.7, 1.3))


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _random_text(rng: np.random.Generator, low: int, high: int) -> str:
    words: list[str] = []
    length = int(rng.integers(low, high + 1))
    while sum(len(word) + 1 for word in words) < length:
        chars = _TEXT_CHARS if rng.random() < 0.5 else _WORD_CHARS
        words.append("".join(_pick(rng, list(chars)) for _ in range(int(rng.integers(2, 9)))))
    return " ".join(words)[:length].strip() or "text"


def _ink(rng: np.random.Generator, background: Any) -> tuple[int, int, int]:
    """A text colour that stands out from ``background``'s mean brightness."""
    mean = float(np.asarray(background.convert("L")).mean())
    base = rng.integers(0, 70, 3) if mean > 110 else rng.integers(190, 256, 3)
    return (int(base[0]), int(base[1]), int(base[2]))


def photo(rng: np.random.Generator, sources: Sources, size: tuple[int, int]) -> Any:
    aspect = size[1] / size[0] * math.exp(rng.uniform(-0.3, 0.3))
    return _lighting(rng, _crop(rng, _pick(rng, sources.photos), aspect))


def face(rng: np.random.Generator, sources: Sources, size: tuple[int, int]) -> Any:
    """A face filling most of the picture: an LFW crop, or a portrait's face with the box
    jittered in place and scale."""
    from PIL import Image

    if rng.random() < 0.7:
        picture = _pick(rng, sources.faces)
        inset = int(rng.integers(0, 3))
        picture = picture.crop((inset, inset, 25 - inset, 25 - inset))
    else:
        image, (left, top, right, bottom) = _pick(rng, sources.portraits)
        side = max(right - left, bottom - top) * rng.uniform(1.0, 1.5)
        centre_x = (left + right) / 2 + rng.uniform(-0.1, 0.1) * side
        centre_y = (top + bottom) / 2 + rng.uniform(-0.1, 0.1) * side
        picture = image.crop((int(centre_x - side / 2), int(centre_y - side / 2),
                              int(centre_x + side / 2), int(centre_y + side / 2)))
    if rng.random() < 0.5:
        picture = picture.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return _lighting(rng, picture)


def faces_in_scene(rng: np.random.Generator, sources: Sources, size: tuple[int, int]) -> Any:
    """A photo crop with one to three faces of different sizes pasted in."""
    height, width = size
    scene = photo(rng, sources, size).resize((width, height))
    for _ in range(int(rng.integers(1, 4))):
        side = int(min(height, width) * rng.uniform(0.15, 0.6))
        picture = face(rng, sources, size).resize((side, side))
        scene.paste(picture, (int(rng.integers(0, width - side + 1)),
                              int(rng.integers(0, height - side + 1))))
    return scene


def text_line(rng: np.random.Generator, sources: Sources, size: tuple[int, int]) -> Any:
    """One line of text over a softened photo crop, cut to the text with a margin."""
    from PIL import Image, ImageDraw

    font = _font(int(rng.integers(26, 40)))
    text = _random_text(rng, 3, 18)
    left, top, right, bottom = font.getbbox(text)
    margin_x, margin_y = int(rng.integers(2, 16)), int(rng.integers(3, 12))
    width, height = right - left + 2 * margin_x, bottom - top + 2 * margin_y
    background = _crop(rng, _pick(rng, sources.photos), width / height).resize((width, height))
    paper = tuple(int(value) for value in rng.integers(0, 256, 3))
    background = Image.blend(background, Image.new("RGB", (width, height), paper),
                             rng.uniform(0.3, 0.9))
    draw = ImageDraw.Draw(background)
    draw.text((margin_x - left, margin_y - top + int(rng.integers(-2, 3))), text,
              fill=_ink(rng, background), font=font)
    return background


def text_line_flipped(rng: np.random.Generator, sources: Sources, size: tuple[int, int]) -> Any:
    """A text line, upside down half the time (what an orientation classifier must tell)."""
    from PIL import Image

    line = text_line(rng, sources, size)
    return line.transpose(Image.Transpose.ROTATE_180) if rng.random() < 0.5 else line


def _draw_characters(rng: np.random.Generator, scene: Any, count: int, font_range: tuple[int, int],
                     *, in_a_row: bool) -> None:
    """Paste ``count`` single characters, each rotated and coloured on its own."""
    from PIL import Image, ImageDraw

    width, height = scene.size
    for index in range(count):
        font = _font(int(rng.integers(*font_range)))
        char = _pick(rng, list(_TEXT_CHARS))
        left, top, right, bottom = font.getbbox(char)
        tile = Image.new("RGBA", (right - left + 8, bottom - top + 8), (0, 0, 0, 0))
        ImageDraw.Draw(tile).text((4 - left, 4 - top), char, font=font,
                                  fill=(*_ink(rng, scene), 255),
                                  stroke_width=int(rng.integers(0, 2)), stroke_fill=(255, 255, 255, 255))
        tile = tile.rotate(rng.uniform(-30, 30), expand=True, resample=Image.Resampling.BICUBIC)
        if in_a_row:
            slot = width / count
            x = int(index * slot + rng.uniform(0, max(1.0, slot - tile.width)))
            y = int(rng.uniform(0, max(1, height - tile.height)))
        else:
            x = int(rng.integers(0, max(1, width - tile.width)))
            y = int(rng.integers(0, max(1, height - tile.height)))
        scene.paste(tile, (x, y), tile)


def captcha(rng: np.random.Generator, sources: Sources, size: tuple[int, int]) -> Any:
    """A text captcha: four to six tilted characters and a few lines over a photo crop."""
    from PIL import ImageDraw

    width, height = int(rng.integers(130, 200)), int(rng.integers(50, 70))
    scene = _lighting(rng, _crop(rng, _pick(rng, sources.photos), width / height)).resize((width, height))
    _draw_characters(rng, scene, int(rng.integers(4, 7)), (28, 44), in_a_row=True)
    draw = ImageDraw.Draw(scene)
    for _ in range(int(rng.integers(1, 4))):
        points = [(int(rng.integers(0, width)), int(rng.integers(0, height))) for _ in range(2)]
        draw.line(points, fill=_ink(rng, scene), width=int(rng.integers(1, 3)))
    return scene


def click_captcha(rng: np.random.Generator, sources: Sources, size: tuple[int, int]) -> Any:
    """A click captcha: a photo with three to six large characters scattered over it."""
    width, height = int(rng.integers(300, 420)), int(rng.integers(150, 260))
    scene = _lighting(rng, _crop(rng, _pick(rng, sources.photos), width / height)).resize((width, height))
    _draw_characters(rng, scene, int(rng.integers(3, 7)), (28, 56), in_a_row=False)
    return scene


def _paragraph(rng: np.random.Generator, sources: Sources, width: int, height: int) -> Any:
    """Lines of dark text on light paper (a photo crop washed out)."""
    from PIL import Image, ImageDraw

    background = _crop(rng, _pick(rng, sources.photos), width / height).resize((width, height))
    paper = tuple(int(value) for value in rng.integers(215, 256, 3))
    page = Image.blend(background, Image.new("RGB", (width, height), paper), rng.uniform(0.75, 0.95))
    draw = ImageDraw.Draw(page)
    font_size = int(rng.integers(13, 24))
    font = _font(font_size)
    y = int(rng.integers(4, 20))
    while y < height - font_size:
        draw.text((int(rng.integers(6, 24)), y), _random_text(rng, 10, 60),
                  fill=tuple(int(value) for value in rng.integers(0, 60, 3)), font=font)
        y += int(font_size * rng.uniform(1.3, 1.8))
    return page


def text_scene(rng: np.random.Generator, sources: Sources, size: tuple[int, int]) -> Any:
    """Text in a scene: a crop of a printed page, or a photo with a few lines of text on it."""
    from PIL import ImageDraw

    height, width = size
    if rng.random() < 0.3:
        return _crop(rng, _pick(rng, sources.documents), width / height, min_fraction=0.5)
    scene = photo(rng, sources, size).resize((width, height))
    draw = ImageDraw.Draw(scene)
    for _ in range(int(rng.integers(2, 7))):
        font = _font(int(rng.integers(14, 42)))
        x, y = int(rng.integers(0, width * 3 // 4)), int(rng.integers(0, height - 14))
        draw.text((x, y), _random_text(rng, 3, 24), font=font, fill=_ink(rng, scene),
                  stroke_width=int(rng.integers(0, 2)))
    return scene


def document(rng: np.random.Generator, sources: Sources, size: tuple[int, int]) -> Any:
    """A page (a scan or rendered text) turned by 0, 90, 180 or 270 degrees."""
    if rng.random() < 0.4:
        page = _crop(rng, _pick(rng, sources.documents), rng.uniform(0.7, 1.4), min_fraction=0.6)
    else:
        page = _paragraph(rng, sources, int(rng.integers(300, 500)), int(rng.integers(300, 500)))
    return page.rotate(90 * int(rng.integers(0, 4)), expand=True)


SCENES: dict[str, Scene] = {
    "photo": photo,
    "face": face,
    "faces-in-scene": faces_in_scene,
    "text-line": text_line,
    "text-line-flipped": text_line_flipped,
    "captcha": captcha,
    "click-captcha": click_captcha,
    "text-scene": text_scene,
    "document": document,
}


# --------------------------------------------------------------------------------------------------
# Preprocessing


def _fit(picture: Any, prep: Preprocessing, height: int, width: int) -> tuple[np.ndarray, int]:
    """The picture brought to height x width as ``prep.fit`` says, as an array (H, W, 3) of
    pixels, and the width of its real part (all of it but for ``pad-right``)."""
    from PIL import Image

    bilinear = Image.Resampling.BILINEAR
    if prep.fit == "stretch":
        return np.asarray(picture.resize((width, height), bilinear)), width
    if prep.fit == "letterbox":
        ratio = min(height / picture.height, width / picture.width)
        resized = picture.resize((max(1, int(picture.width * ratio)),
                                  max(1, int(picture.height * ratio))), bilinear)
        canvas = Image.new("RGB", (width, height), (prep.pad_pixel,) * 3)
        canvas.paste(resized, (0, 0))
        return np.asarray(canvas), width
    if prep.fit == "pad-right":
        used = min(width, math.ceil(height * picture.width / picture.height))
        padded = np.zeros((height, width, 3), dtype=np.uint8)
        padded[:, :used] = np.asarray(picture.resize((used, height), bilinear))
        return padded, used
    if prep.fit == "center-crop":
        short = round(min(height, width) / prep.crop_fraction)
        ratio = short / min(picture.width, picture.height)
        resized = picture.resize((max(width, round(picture.width * ratio)),
                                  max(height, round(picture.height * ratio))), bilinear)
        left, top = (resized.width - width) // 2, (resized.height - height) // 2
        return np.asarray(resized.crop((left, top, left + width, top + height))), width
    raise ValueError(f"unknown fit {prep.fit!r}")


def preprocess(picture: Any, prep: Preprocessing) -> np.ndarray:
    """One input sample (no batch axis) from a picture, in the model's layout and scaling."""
    height, width = prep.size[::-1] if prep.transpose_hw else prep.size
    pixels, used = _fit(picture.convert("RGB"), prep, height, width)
    if prep.channels == "GRAY":
        # ITU-R 601 luma, as Pillow's convert("L") computes it.
        pixels = (pixels @ np.array([0.299, 0.587, 0.114]))[..., None]
        mean, std = prep.mean[:1], prep.std[:1]
    else:
        pixels = pixels[..., ::-1] if prep.channels == "BGR" else pixels
        mean, std = prep.mean, prep.std
    values = ((pixels.astype(np.float32) * np.float32(prep.scale) - np.asarray(mean, np.float32))
              / np.asarray(std, np.float32))
    if used < width:  # PaddleOCR pads after normalising: the padding is zero, not black
        values[:, used:] = 0.0
    if prep.transpose_hw:
        values = values.transpose(1, 0, 2)
    if prep.layout == "NCHW":
        values = values.transpose(2, 0, 1)
    return np.ascontiguousarray(values, dtype=np.float32)


def _seed(entry: ModelEntry, split: str) -> list[int]:
    return [zlib.crc32(entry.name.encode()), zlib.crc32(split.encode())]


def make_samples(entry: ModelEntry, sources: Sources, count: int, split: str) -> np.ndarray:
    """``count`` preprocessed samples for ``entry`` (count x sample shape); ``split`` names an
    independent set (``calib``, ``eval``)."""
    rng = np.random.default_rng(_seed(entry, split))
    scene = SCENES[entry.scene]
    prep = entry.preprocessing
    picture_size = prep.size[::-1] if prep.transpose_hw else prep.size
    return np.stack([preprocess(scene(rng, sources, picture_size), prep) for _ in range(count)])


def write_samples(directory: Path, samples: np.ndarray) -> Path:
    """One ``.npy`` file a sample, named in order (``sample-0000.npy``, ...), replacing what the
    directory held."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.npy"):
        stale.unlink()
    for index, sample in enumerate(samples):
        np.save(directory / f"sample-{index:04d}.npy", sample)
    return directory
