"""The chandra-ocr adapter: request bodies, retry policy and post-processing of one page.

Pure functions, no network. Everything model-specific comes from the installed
``chandra-ocr`` package (0.2.0, Chandra 2): the prompt (``chandra.prompts``), the
resize rule and the repetition detector (``chandra.model.util``), the first-try
sampling (``chandra.model.vllm.generate_vllm`` defaults) and the HTML → Markdown /
HTML / layout / image-crop conversions (``chandra.output``). The only thing retyped
here is the retry temperature schedule, which is inline in ``generate_vllm``.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import functools
import importlib.util
import io
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from chandra.prompts import PROMPT_MAPPING

from chandrad import png
from chandrad.errors import InputError, NoPagePixels
from chandrad.interfaces import EncodedJson

if TYPE_CHECKING:
    from PIL import Image

# chandra.model (it imports openai) and chandra.output (bs4, markdownify) cost ~85 MB
# resident; they are imported inside the functions below, which the daemon runs in its
# render worker processes (RenderPool.postprocess), not in the daemon process itself.

#: Retry schedule, from ``generate_vllm.process_item`` in chandra-ocr 0.2.0:
#: ``temperature = min(temperature + 0.2 * (retries + 1), 0.8)`` with ``top_p=0.95``.
RETRY_TEMPERATURE_STEP = 0.2
RETRY_TEMPERATURE_MAX = 0.8
RETRY_TOP_P = 0.95
#: Chandra's own ``scale_to_fit`` defaults, which its vLLM client applies to every page.
_CHANDRA_MAX_SIZE = (3072, 2048)
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: Encoder effort for WebP image crops (0 fastest .. 6 smallest; Pillow's default is 4).
WEBP_METHOD = 0


@functools.cache
def chandra_util() -> ModuleType:
    """``chandra.model.util`` (``scale_to_fit``, ``detect_repeat_token``; it imports only
    Pillow), loaded from its file on its own: importing it as ``chandra.model.util`` first
    runs ``chandra/model/__init__.py``, which imports chandra's HF and vLLM clients and
    openai, ~20 MB resident in every render worker for code chandrad never calls."""
    spec = importlib.util.find_spec("chandra")
    if spec is None or spec.origin is None:
        raise RuntimeError("chandra-ocr is not installed")
    source = Path(spec.origin).with_name("model") / "util.py"
    util_spec = importlib.util.spec_from_file_location("chandrad._chandra_model_util", source)
    if util_spec is None or util_spec.loader is None:
        raise RuntimeError(f"cannot load {source}")
    module = importlib.util.module_from_spec(util_spec)
    util_spec.loader.exec_module(module)
    return module


@functools.cache
def first_sampling() -> tuple[float, float]:
    """(temperature, top_p) of Chandra's first try: the defaults of ``generate_vllm``.

    Read from the installed chandra-ocr source with ``ast`` rather than by importing
    ``chandra.model.vllm``, which would load openai into the daemon.
    """
    spec = importlib.util.find_spec("chandra")
    if spec is None or spec.origin is None:
        raise RuntimeError("chandra-ocr is not installed")
    source = Path(spec.origin).with_name("model") / "vllm.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "generate_vllm":
            args = node.args.args[-len(node.args.defaults):] if node.args.defaults else []
            defaults = dict(zip((a.arg for a in args), node.args.defaults, strict=True))
            return (float(ast.literal_eval(defaults["temperature"])),
                    float(ast.literal_eval(defaults["top_p"])))
    raise RuntimeError(f"generate_vllm not found in {source}")


@dataclass
class PageResult:
    """One page after Chandra's post-processing."""

    markdown: str
    html: str
    blocks: list[dict[str, Any]]  # {"label", "bbox": [x0, y0, x1, y1] in page pixels, "html"}
    images: dict[str, bytes]  # file name (as referenced by the HTML) → encoded image
    notes: list[str] = field(default_factory=list)  # what chandra complained about


def _png_size(png: bytes) -> tuple[int, int]:
    if len(png) < 24 or not png.startswith(_PNG_SIGNATURE) or png[12:16] != b"IHDR":
        raise InputError("page image is not a PNG")
    width, height = struct.unpack(">II", png[16:24])
    return int(width), int(height)


def _as_sent(page_png: bytes) -> bytes:
    """The PNG Chandra's client would send: ``scale_to_fit`` applied if it changes anything."""
    from PIL import Image

    scale_to_fit = chandra_util().scale_to_fit
    image = Image.open(io.BytesIO(page_png))
    fitted = scale_to_fit(image, max_size=_CHANDRA_MAX_SIZE)
    if fitted is image:
        return page_png
    buf = io.BytesIO()
    fitted.save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class PageImage:
    """One rendered page, as the daemon holds it from render to post-processing: a PNG
    (8-bit RGB, or greyscale for a greyscale source), which each request writes in base64
    as it is sent (:class:`EncodedJson`), and its pixel size. ``png`` is empty in a copy
    sent to post-processing that needs only the size (:meth:`for_answer`)."""

    index: int  # 0-based
    width: int
    height: int
    png: bytes

    def for_answer(self, text: str, *, include_images: bool) -> PageImage:
        """What post-processing of ``text`` needs of the page: all of it where the answer
        may have an image crop, else only its size (``parse_chunks`` reads only that).

        ``chandra.output.extract_images`` crops only blocks holding an ``img`` element,
        which the HTML parser finds only where the answer has ``<img`` (the tag name in
        any case); an answer without it is never cropped from."""
        if include_images and "<img" in text.lower():
            return self
        return PageImage(self.index, self.width, self.height, b"")


def _chat_body(
    image_b64: str, *, model: str, prompt_type: str, max_output_tokens: int | None,
    temperature: float, top_p: float,
) -> dict[str, Any]:
    try:
        prompt = PROMPT_MAPPING[prompt_type]
    except KeyError:
        known = ", ".join(sorted(PROMPT_MAPPING))
        raise InputError(f"unknown prompt type {prompt_type!r} (known: {known})") from None
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": f"data:image/png;base64,{image_b64}"},
                    },
                    {"type": "text", "text": prompt},
                ],
            }
        ],
        "temperature": temperature,
        "top_p": top_p,
    }
    if max_output_tokens is not None:
        body["max_tokens"] = max_output_tokens
    return body


def build_chat_request(
    page_png: bytes,
    *,
    model: str,
    prompt_type: str,
    max_output_tokens: int | None,
    temperature: float,
    top_p: float,
    fitted: bool = False,
) -> dict[str, Any]:
    """The OpenAI chat-completions body for one page, as ``chandra.model.vllm`` builds it.

    One user message, image first (PNG data URL) then the prompt, no system prompt.
    Pages from :mod:`chandrad.render` already have the size ``scale_to_fit`` wants
    (``fitted=True``) and are sent byte for byte; any other PNG is resized by Chandra's
    rule first. ``max_output_tokens=None`` leaves ``max_tokens`` out: the engine then
    allows exactly what its context leaves after the prompt (see :func:`request_max_tokens`).
    """
    _png_size(page_png)
    image_b64 = base64.b64encode(page_png if fitted else _as_sent(page_png)).decode("ascii")
    return _chat_body(image_b64, model=model, prompt_type=prompt_type,
                      max_output_tokens=max_output_tokens, temperature=temperature,
                      top_p=top_p)


#: Stands for the image in the encoded body; JSON writes the NULs as ``\u0000``, which
#: neither a prompt nor the model name written by JSON can contain followed by this word.
_IMAGE_SLOT = "\x00chandrad-image\x00"


def encode_chat_request(
    page: PageImage,
    *,
    model: str,
    prompt_type: str,
    max_output_tokens: int | None,
    temperature: float,
    top_p: float,
) -> EncodedJson:
    """:func:`build_chat_request` of a rendered page (``fitted=True``), encoded as JSON
    the way httpx encodes ``json=`` (UTF-8, no spaces): the same bytes, around the page's
    PNG, which is written in base64 only as the body is sent (base64 needs no JSON
    escapes)."""
    text = json.dumps(
        _chat_body(_IMAGE_SLOT, model=model, prompt_type=prompt_type,
                   max_output_tokens=max_output_tokens, temperature=temperature, top_p=top_p),
        ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    head, slot, tail = text.partition(json.dumps(_IMAGE_SLOT)[1:-1])
    if not slot:
        raise RuntimeError("the image's place was not found in the encoded request")
    return EncodedJson(head.encode("utf-8"), page.png, tail.encode("utf-8"))


def request_max_tokens(budget: int, max_model_len: int | None, prompt_tokens: int) -> int:
    """``max_tokens`` for one page: the output budget, cut to what the context leaves.

    vLLM up to 0.17 answers 400 when ``max_tokens`` exceeds what ``max_model_len`` leaves
    after the prompt (MinerU#4868; later versions clamp by themselves).
    ``prompt_tokens`` is an upper estimate: where it leaves room, ``max_tokens`` is cut to
    that room, which then surely fits. Where it leaves none, the estimate is no guide (a
    model that counts image tokens otherwise) and the budget is sent, at most
    ``max_model_len``: a newer engine clamps it, an older one answers 400 naming the real
    prompt length, and
    :func:`context_overflow` turns that into the exact value for a second request.
    """
    if max_model_len is None:
        return budget
    room = max_model_len - prompt_tokens
    # vLLM 0.32 refuses max_tokens > max_model_len outright ("cannot be greater than").
    return min(budget, room) if room > 0 else min(budget, max_model_len)


_INPUT_TOKENS = (
    re.compile(r"your request has (\d+) input tokens"),  # vLLM 0.10-0.17
    re.compile(r"\((\d+) in the messages"),  # vLLM before 0.10
)


def context_overflow(message: str) -> tuple[bool, int | None]:
    """Whether an engine's 400 says ``max_tokens`` did not fit after the prompt, and the
    prompt's real token count when the message gives it."""
    if "cannot be greater than max_model_len" in message:
        return True, None
    if "maximum context length" not in message or not (
            "max_tokens" in message or "in the completion" in message):
        return False, None
    for pattern in _INPUT_TOKENS:
        found = pattern.search(message)
        if found:
            return True, int(found.group(1))
    return True, None


def error_retry_delay(attempt: int) -> float:
    """Seconds to wait before retrying after a request error: Chandra's ``2 * (retries + 1)``.

    ``attempt`` is the number of attempts made so far (1 after the first).
    """
    return 2.0 * max(attempt, 1)


def sampling_for_attempt(attempt: int) -> tuple[float, float]:
    """(temperature, top_p) for ``attempt`` (0 = first try, 1 = first retry, ...)."""
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    first_temperature, first_top_p = first_sampling()
    if attempt == 0:
        return first_temperature, first_top_p
    temperature = min(first_temperature + RETRY_TEMPERATURE_STEP * attempt,
                      RETRY_TEMPERATURE_MAX)
    return round(temperature, 6), RETRY_TOP_P


def retry_reason(text: str, finish_reason: str | None) -> str | None:
    """Why this answer should be retried: ``"repetition"`` or None.

    Chandra's test (``_should_retry``): the tail repeats, or it does once the last 50
    characters are cut off. ``finish_reason == "length"`` is NOT a reason, as in
    Chandra: the cut-off text is kept and the page is marked truncated.
    """
    del finish_reason  # kept in the signature: the caller passes what the engine said
    detect_repeat_token = chandra_util().detect_repeat_token
    if detect_repeat_token(text) or (len(text) > 50 and detect_repeat_token(text, cut_from_end=50)):
        return "repetition"
    return None


def _encode_crop(name: str, image: Image.Image) -> bytes:
    """Encode in the format the name promises (Chandra names crops ``*_img.webp``)."""
    suffix = name.rsplit(".", 1)[-1].lower()
    fmt = {"webp": "WEBP", "png": "PNG", "jpg": "JPEG", "jpeg": "JPEG"}.get(suffix, "PNG")
    if fmt == "JPEG" and image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    buf = io.BytesIO()
    # WebP at Pillow's default quality (80) but encoder effort 0 instead of 4: less CPU
    # for somewhat larger files (the figures: bench/README.md, "Current figures").
    image.save(buf, format=fmt, **({"method": WEBP_METHOD} if fmt == "WEBP" else {}))
    return buf.getvalue()


class _LazyPage:
    """The page as ``chandra.output`` uses it: ``parse_chunks`` reads only ``.size`` and
    ``extract_images`` only calls ``.crop``; the PNG is inflated on the first crop and
    only down to the lowest row asked for so far, so a page without figures is never
    decoded and a figure in the upper half of a page costs half the inflate.

    A crop is what ``Image.crop`` of the page converted to RGB (as Chandra's own page
    images are) gives, pixel for pixel, but copies only the crop's rows out of the
    inflated PNG (converting a pixel to RGB does not depend on its neighbours, so
    cropping first is the same). A box reaching outside the page (Pillow fills with
    black) takes the whole-page path.
    """

    def __init__(self, page: bytes | PageImage) -> None:
        self._png: bytes
        if isinstance(page, PageImage):
            self.size = (page.width, page.height)
            self._png = page.png
        else:
            self.size = _png_size(page)
            self._png = page
        self._rows: png.Rows | None = None
        self._rgb: Image.Image | None = None

    def _page_png(self) -> bytes:
        if not self._png:
            raise NoPagePixels("a crop was asked of a page sent without its pixels")
        return self._png

    def _pillow_rgb(self) -> Image.Image:
        from PIL import Image

        with Image.open(io.BytesIO(self._page_png())) as img:
            self._rgb = img.convert("RGB")
        return self._rgb

    def crop(self, box: Any) -> Image.Image:
        from PIL import Image

        if self._rgb is None and self._rows is None:
            self._rows = png.Rows.open(self._page_png())
        if self._rgb is not None or self._rows is None:  # not a PNG chandrad wrote
            return (self._rgb or self._pillow_rgb()).crop(box)
        rows = self._rows
        # Image.crop's own checks and rounding.
        if box[2] < box[0]:
            raise ValueError("Coordinate 'right' is less than 'left'")
        if box[3] < box[1]:
            raise ValueError("Coordinate 'lower' is less than 'upper'")
        x0, y0, x1, y1 = (int(round(v)) for v in box)
        mode, stride = rows.mode, rows.stride
        inside = 0 <= x0 < x1 <= rows.width and 0 <= y0 < y1 <= rows.height
        # Only the rows down to the crop's last are inflated (the first crop's, usually).
        pixels = rows.upto(y1 if inside else rows.height)
        if pixels is None:  # not ours after all (filtered rows, corrupt)
            return self._pillow_rgb().crop(box)
        if inside:
            channels = len(mode)
            start = y0 * stride + x0 * channels
            end = (y1 - 1) * stride + x1 * channels
            crop = Image.frombytes(mode, (x1 - x0, y1 - y0), pixels[start:end], "raw",
                                   mode, stride, 1)
            return crop if mode == "RGB" else crop.convert("RGB")
        page = Image.frombytes(mode, (rows.width, rows.height), pixels, "raw", mode, stride, 1)
        self._rgb = page if mode == "RGB" else page.convert("RGB")
        return self._rgb.crop(box)


def markdown_of(html: str) -> str:
    """``chandra.output.parse_markdown`` of the raw answer, given what ``parse_html`` made
    of it (``parse_markdown`` runs ``parse_html`` itself; the page's HTML is needed too,
    so it is parsed once instead of twice). The converter's settings are
    ``parse_markdown``'s own; ``tests/test_ocr.py`` asserts the same Markdown."""
    from chandra.output import Markdownify

    converter = Markdownify(
        heading_style="ATX",
        bullets="-",
        escape_misc=False,
        escape_underscores=True,
        escape_asterisks=True,
        escape_dollars=True,
        sub_symbol="<sub>",
        sup_symbol="<sup>",
        inline_math_delimiters=("$", "$"),
        block_math_delimiters=("$$", "$$"),
    )
    try:
        markdown = str(converter.convert(html))
    except Exception as e:
        print(f"Error converting HTML to Markdown: {e}")  # chandra's note, as it prints it
        markdown = ""
    return markdown.strip()


def parse_page(
    raw_html: str,
    page: bytes | PageImage,
    *,
    include_images: bool,
    include_headers_footers: bool,
) -> PageResult:
    """Post-process the model's raw HTML for one page with ``chandra.output``.

    Never raises on bad model output: each conversion that fails leaves its part empty
    and adds a note. ``bbox`` values are in the page's pixels. ``page``: the page's PNG,
    or a :class:`PageImage` (its PNG, inflated only for a crop, or its size alone).
    """
    from chandra.output import extract_images, parse_chunks, parse_html
    from chandra.settings import settings as chandra_settings

    notes: list[str] = []
    chandra_said = io.StringIO()  # chandra.output prints its complaints to stdout
    markdown = html = ""
    chunks: list[dict[str, Any]] = []
    images: dict[str, bytes] = {}
    lazy = _LazyPage(page)
    with contextlib.redirect_stdout(chandra_said):
        try:
            html = str(
                parse_html(
                    raw_html,
                    include_headers_footers=include_headers_footers,
                    include_images=include_images,
                )
            )
            markdown = markdown_of(html)
        except Exception as exc:  # chandra.output on arbitrary model text
            notes.append(f"html/markdown conversion failed: {exc!r}")
        try:
            chunks = list(parse_chunks(raw_html, lazy, bbox_scale=chandra_settings.BBOX_SCALE))
        except Exception as exc:
            notes.append(f"layout parsing failed: {exc!r}")
        if include_images and chunks:
            try:
                crops = extract_images(raw_html, chunks, lazy)
                images = {str(name): _encode_crop(str(name), crop) for name, crop in crops.items()}
            except NoPagePixels:
                raise
            except Exception as exc:
                notes.append(f"image extraction failed: {exc!r}")
    notes.extend(line for line in chandra_said.getvalue().splitlines() if line.strip())
    blocks = [
        {"label": str(c["label"]), "bbox": [int(v) for v in c["bbox"]], "html": str(c["content"])}
        for c in chunks
    ]
    return PageResult(markdown=markdown, html=html, blocks=blocks, images=images, notes=notes)


def postprocess(
    text: str,
    finish_reason: str | None,
    page: bytes | PageImage,
    *,
    include_images: bool,
    include_headers_footers: bool,
) -> PageResult | str:
    """One answer → the retry reason (``str``) or the parsed page. Runs in a worker."""
    reason = retry_reason(text, finish_reason)
    if reason is not None:
        return reason
    return parse_page(text, page, include_images=include_images,
                      include_headers_footers=include_headers_footers)
