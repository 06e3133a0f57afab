"""Tests for chandrad.ocr against chandra-ocr's own client, prompts and post-processing.

Chandra's vLLM client (``chandra.model.vllm.generate_vllm``) is run for real against the
stand-in engine process (tests/standin_engine.py), which speaks the OpenAI chat-completions
protocol and records every request body; chandrad's request builder and retry schedule
must match what it sent.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chandra.model.schema import BatchInputItem
from chandra.model.util import detect_repeat_token
from chandra.model.vllm import generate_vllm
from chandra.prompts import PROMPT_MAPPING
from conftest import CORPUS_DIR
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from standin_engine import StandinServer, standin_server

from chandrad import errors
from chandrad.engine.client import EngineClient
from chandrad.errors import NoPagePixels
from chandrad.interfaces import BASE64_SLICE_BYTES, EncodedJson
from chandrad.ocr import (
    PageImage,
    build_chat_request,
    encode_chat_request,
    parse_page,
    postprocess,
    retry_reason,
    sampling_for_attempt,
)
from chandrad.render import render_page


@pytest.fixture
def openai_server(tmp_path: Path) -> Iterator[StandinServer]:
    """The stand-in engine process, recording every request body (its image included)."""
    with standin_server(tmp_path / "engine", {"record_messages": True,
                                              "default": {"content": ""}}) as server:
        yield server


def _bodies(server: StandinServer) -> list[dict[str, Any]]:
    return [e["body"] for e in server.chats()]


def _answer(server: StandinServer, content: str) -> None:
    server.update(default={"content": content})


@pytest.fixture(scope="module")
def page_png() -> bytes:
    return render_page(CORPUS_DIR / "good/scan_book-page_c02-22.pdf", 0, 1024, 6291456).png


def _pixels(data_url: str) -> tuple[tuple[int, int], bytes]:
    prefix = "data:image/png;base64,"
    assert data_url.startswith(prefix)
    with Image.open(io.BytesIO(base64.b64decode(data_url[len(prefix) :]))) as img:
        return img.size, img.convert("RGB").tobytes()


def _split_image(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    body = json.loads(json.dumps(body))
    part = body["messages"][0]["content"][0]
    url = str(part["image_url"]["url"])
    part["image_url"]["url"] = "<image>"
    return body, url


def _run_chandra(server: StandinServer, image: Image.Image) -> None:
    generate_vllm(
        [BatchInputItem(image=image, prompt_type="ocr_layout")],
        max_output_tokens=12384,
        max_retries=6,
        vllm_api_base=f"{server.url}/v1",
    )


def test_request_matches_chandras_client(openai_server: StandinServer, page_png: bytes) -> None:
    """The body equals what chandra's vLLM client sends for the same page, pixel for pixel."""
    _answer(openai_server, '<div data-bbox="0 0 10 10" data-label="Text"><p>ok</p></div>')
    _run_chandra(openai_server, Image.open(io.BytesIO(page_png)))
    assert len(_bodies(openai_server)) == 1
    theirs, their_url = _split_image(_bodies(openai_server)[0])
    t0, p0 = sampling_for_attempt(0)
    ours, our_url = _split_image(
        build_chat_request(
            page_png,
            model="chandra",
            prompt_type="ocr_layout",
            max_output_tokens=12384,
            temperature=t0,
            top_p=p0,
        )
    )
    assert ours == theirs
    assert _pixels(our_url) == _pixels(their_url)
    assert our_url == "data:image/png;base64," + base64.b64encode(page_png).decode()


def _page_image(png: bytes) -> PageImage:
    with Image.open(io.BytesIO(png)) as img:
        width, height = img.size
    return PageImage(0, width, height, png)


@pytest.mark.parametrize("max_tokens", [None, 12384])
def test_encoded_request_is_the_bytes_httpx_sends_for_the_dict(page_png: bytes,
                                                               max_tokens: int | None) -> None:
    """The pipeline's body, encoded around the worker's PNG, is byte for byte what httpx
    sends for ``build_chat_request`` (``json=``), whatever the prompt's characters."""
    for prompt_type in sorted(PROMPT_MAPPING):
        kwargs: dict[str, Any] = dict(model="chandra/é \"q\"", prompt_type=prompt_type,
                                      max_output_tokens=max_tokens, temperature=0.3,
                                      top_p=0.95)
        encoded = encode_chat_request(_page_image(page_png), **kwargs)
        as_dict = build_chat_request(page_png, fitted=True, **kwargs)
        sent = httpx.Request("POST", "http://x/", json=as_dict).content
        assert b"".join(encoded.parts()) == sent
        assert encoded.size == len(sent)
    with pytest.raises(errors.InputError):
        encode_chat_request(_page_image(page_png), model="m", prompt_type="nope",
                            max_output_tokens=None, temperature=0.0, top_p=1.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=3 * BASE64_SLICE_BYTES + 4))
def test_an_encoded_body_writes_its_image_in_base64_slice_by_slice(length: int) -> None:
    """Whatever the image's length (a multiple of the slice or not, shorter than one),
    the slices' base64 is the whole image's, and ``size`` is the body's length."""
    image = bytes(i % 251 for i in range(length))
    body = EncodedJson(b'{"url":"data:image/png;base64,', image, b'"}')
    sent = b"".join(body.parts())
    assert sent == body.head + base64.b64encode(image) + body.tail
    assert body.size == len(sent)


def test_the_engine_receives_the_encoded_request_whole(openai_server: StandinServer,
                                                       page_png: bytes) -> None:
    """EngineClient.chat sends an encoded body part after part with its Content-Length
    (the stand-in reads exactly that many bytes): the engine parses the same request as
    from the dict, the page's PNG unchanged in its base64 (written slice by slice as
    it is sent: the page is several slices)."""
    _answer(openai_server, "fine")
    page = render_page(CORPUS_DIR / "good/scan_book-page_c02-22.pdf", 0, 1024, 6291456)
    assert page.png == page_png
    assert len(page.png) > 2 * BASE64_SLICE_BYTES
    kwargs: dict[str, Any] = dict(model="chandra", prompt_type="ocr_layout",
                                  max_output_tokens=100, temperature=0.0, top_p=0.1)

    async def send() -> dict[str, Any]:
        client = EngineClient(openai_server.url)
        try:
            return await client.chat(encode_chat_request(page, **kwargs))
        finally:
            await client.close()

    reply = asyncio.run(send())
    assert reply["choices"][0]["message"]["content"] == "fine"
    assert _bodies(openai_server) == [build_chat_request(page_png, fitted=True, **kwargs)]


TEXT_ONLY = '<div data-bbox="100 100 900 300" data-label="Text"><p>no figure</p></div>'


def test_post_processing_gets_the_pixels_only_for_an_answer_with_an_image(
        page_png: bytes) -> None:
    """A page goes to post-processing with its size alone unless the answer has ``<img``
    (in any case) and crops are wanted; the result is the same as from the whole page."""
    from tiny_model import PLANTED_TEXT

    page = _page_image(page_png)
    assert page.for_answer(PLANTED_TEXT, include_images=True) is page
    assert page.for_answer(RAW.replace("<img", "<IMG"), include_images=True) is page
    for text, images in [(PLANTED_TEXT, False), (TEXT_ONLY, True), (TEXT_ONLY, False),
                         (RAW, False)]:
        sent = page.for_answer(text, include_images=images)
        assert (sent.png, sent.width, sent.height) == (b"", page.width, page.height)
        for headers in (False, True):
            ours = postprocess(text, "stop", sent, include_images=images,
                               include_headers_footers=headers)
            whole = parse_page(text, page_png, include_images=images,
                               include_headers_footers=headers)
            assert ours == whole
    with_crop = postprocess(PLANTED_TEXT, "stop", page, include_images=True,
                            include_headers_footers=False)
    assert with_crop == parse_page(PLANTED_TEXT, page_png, include_images=True,
                                   include_headers_footers=False)
    assert not isinstance(with_crop, str) and len(with_crop.images) == 1
    with pytest.raises(NoPagePixels):  # never silently a page without its crop
        postprocess(PLANTED_TEXT, "stop", PageImage(0, page.width, page.height, b""),
                    include_images=True, include_headers_footers=False)


def test_unfitted_image_is_resized_like_chandra(openai_server: StandinServer) -> None:
    """A PNG that is not at scale_to_fit's size is resized exactly as chandra's client does."""
    big = Image.new("RGB", (3500, 2600), "white")
    big.paste((10, 20, 30), (100, 100, 900, 700))
    buf = io.BytesIO()
    big.save(buf, format="PNG")
    _run_chandra(openai_server, big)
    _, their_url = _split_image(_bodies(openai_server)[0])
    request = build_chat_request(
        buf.getvalue(),
        model="chandra",
        prompt_type="ocr_layout",
        max_output_tokens=100,
        temperature=0.0,
        top_p=0.1,
    )
    _, our_url = _split_image(request)
    size, pixels = _pixels(our_url)
    assert size[0] * size[1] <= 6291456
    assert (size, pixels) == _pixels(their_url)


def test_retry_schedule_matches_chandra(openai_server: StandinServer, page_png: bytes) -> None:
    """Chandra's client, fed a repetition loop each time, retries with our schedule."""
    _answer(openai_server, "<div>" + "la " * 300)
    _run_chandra(openai_server, Image.open(io.BytesIO(page_png)))
    sent = [(b["temperature"], b["top_p"]) for b in _bodies(openai_server)]
    assert len(sent) == 7  # first try + MAX_VLLM_RETRIES
    ours = [sampling_for_attempt(i) for i in range(7)]
    for (t_sent, p_sent), (t_ours, p_ours) in zip(sent, ours, strict=True):
        assert t_sent == pytest.approx(t_ours) and p_sent == pytest.approx(p_ours)
    assert sampling_for_attempt(20) == sampling_for_attempt(4)


def test_prompt_comes_from_chandra_and_unknown_type_is_refused(page_png: bytes) -> None:
    """Both of Chandra's prompt types are sent verbatim; an unknown one is an error."""
    for prompt_type, prompt in PROMPT_MAPPING.items():
        body = build_chat_request(
            page_png,
            model="m",
            prompt_type=prompt_type,
            max_output_tokens=5,
            temperature=0.2,
            top_p=0.95,
        )
        assert body["messages"][0]["content"][1] == {"type": "text", "text": prompt}
        assert (body["max_tokens"], body["temperature"], body["top_p"]) == (5, 0.2, 0.95)
    with pytest.raises(errors.InputError, match="unknown prompt type"):
        build_chat_request(
            page_png,
            model="m",
            prompt_type="nope",
            max_output_tokens=5,
            temperature=0.0,
            top_p=0.1,
        )


def test_retry_reason() -> None:
    """Repetition (also hidden by a 50-char tail) asks for a retry; a cut by length does not
    (Chandra keeps the cut-off text)."""
    looped = "<p>" + "x y " * 200
    assert retry_reason(looped, "stop") == "repetition"
    tail_hidden = "<p>" + "ab" * 200 + "then a different 40-char ending here..."
    assert not detect_repeat_token(tail_hidden)
    assert retry_reason(tail_hidden, "stop") == "repetition"
    assert retry_reason("<p>A normal paragraph of text.</p>", "length") is None
    assert retry_reason(looped, "length") == "repetition"
    assert retry_reason("<p>A normal paragraph of text.</p>", "stop") is None
    assert retry_reason("", None) is None


RAW = (
    '<div data-bbox="0 0 1000 50" data-label="Page-Header"><p>CHAPTER XXII</p></div>'
    '<div data-bbox="100 100 900 300" data-label="Section-Header"><h2>The Circus</h2></div>'
    '<div data-bbox="100 300 900 600" data-label="Text">Costs $5 and <math>x^2</math></div>'
    '<div data-bbox="200 600 800 900" data-label="Image"><img alt="a horse"/>drawing</div>'
    '<div data-bbox="0 950 1000 1000" data-label="Page-Footer"><p>22</p></div>'
)


def test_parse_page_blocks_in_page_pixels(page_png: bytes) -> None:
    """Blocks carry label, bbox scaled from 0-1000 to the page's pixels, and their HTML."""
    with Image.open(io.BytesIO(page_png)) as img:
        width, height = img.size
    result = parse_page(RAW, page_png, include_images=True, include_headers_footers=False)
    labels = [b["label"] for b in result.blocks]
    assert labels == ["Page-Header", "Section-Header", "Text", "Image", "Page-Footer"]
    assert result.blocks[1]["bbox"] == [
        int(100 * width / 1000),
        int(100 * height / 1000),
        int(900 * width / 1000),
        int(300 * height / 1000),
    ]
    assert "The Circus" in result.blocks[1]["html"]
    assert "## The Circus" in result.markdown
    assert "\\$5" in result.markdown and "$x^2$" in result.markdown
    assert "CHAPTER XXII" not in result.markdown and "CHAPTER XXII" not in result.html


def test_parse_page_headers_and_images_follow_flags(page_png: bytes) -> None:
    """Header/footer and image inclusion follow the flags; crops decode at the bbox size."""
    with_all = parse_page(RAW, page_png, include_images=True, include_headers_footers=True)
    assert "CHAPTER XXII" in with_all.markdown
    assert len(with_all.images) == 1
    name, data = next(iter(with_all.images.items()))
    assert name in with_all.html and name in with_all.markdown
    x0, y0, x1, y1 = with_all.blocks[3]["bbox"]
    with Image.open(io.BytesIO(data)) as crop:
        assert crop.format == "WEBP"
        assert crop.size == (x1 - x0, y1 - y0)
    without = parse_page(RAW, page_png, include_images=False, include_headers_footers=False)
    assert without.images == {}
    assert "<img" not in without.html
    assert [b["label"] for b in without.blocks][3] == "Image"  # layout still lists it


def test_parse_page_notes_bad_bbox(page_png: bytes) -> None:
    """A malformed bbox does not crash; chandra's complaint is kept as a note, not printed."""
    raw = '<div data-bbox="12 x" data-label="Text"><p>hi</p></div>'
    result = parse_page(raw, page_png, include_images=True, include_headers_footers=False)
    assert result.blocks == [{"label": "Text", "bbox": [0, 0, 1, 1], "html": "<p>hi</p>"}]
    assert any("Invalid bbox" in note for note in result.notes)


@settings(max_examples=40, deadline=None)
@given(
    raw=st.one_of(
        st.text(max_size=400),
        st.lists(
            st.sampled_from(
                [
                    "<div ",
                    'data-bbox="',
                    "1 2 3 4",
                    "-5 9999 0",
                    '" ',
                    'data-label="Image"',
                    'data-label="Table"',
                    ">",
                    "<img>",
                    "<table><tr><td>",
                    "</div>",
                    "<math display='block'>",
                    "\x00",
                    "é漢",
                ]
            ),
            max_size=40,
        ).map("".join),
    )
)
def test_parse_page_survives_garbage(raw: str) -> None:
    """Random model output never raises; bboxes stay lists of four ints."""
    png = _small_png()
    result = parse_page(raw, png, include_images=True, include_headers_footers=False)
    assert isinstance(result.markdown, str) and isinstance(result.html, str)
    assert result.markdown == _chandras_markdown(raw, images=True, headers=False)
    for block in result.blocks:
        assert len(block["bbox"]) == 4 and all(isinstance(v, int) for v in block["bbox"])


def _chandras_markdown(raw: str, *, images: bool, headers: bool) -> str:
    """``chandra.output.parse_markdown``, quietly; "" where it raises (parse_page's note)."""
    from chandra.output import parse_markdown

    with contextlib.redirect_stdout(io.StringIO()):
        try:
            return str(parse_markdown(raw, include_headers_footers=headers,
                                      include_images=images))
        except Exception:
            return ""


MARKDOWN_SAMPLES = [
    '<div data-bbox="1 2 3 4" data-label="Text"><h1>T</h1><ul><li>a*b_c$d</li><li>e</li>'
    '</ul><p>x<sub>2</sub>y<sup>3</sup> <math>m^2</math> <a href="u">l</a></p>'
    '<math display="block">k</math><table><tr><td>1</td></tr></table></div>',
    '<div data-bbox="0 0 9 9" data-label="Page-Header"><p>head</p></div>'
    '<div data-bbox="0 0 9 9" data-label="Image"></div><div data-label="Text">plain</div>',
]


@pytest.mark.parametrize("headers", [False, True])
@pytest.mark.parametrize("images", [False, True])
def test_markdown_is_chandras_parse_markdown(images: bool, headers: bool,
                                             page_png: bytes) -> None:
    """parse_page parses the answer's HTML once (parse_markdown would parse it again):
    its Markdown is still exactly chandra's, for every flag."""
    from tiny_model import PLANTED_TEXT

    for raw in [PLANTED_TEXT, *MARKDOWN_SAMPLES]:
        result = parse_page(raw, page_png, include_images=images,
                            include_headers_footers=headers)
        assert result.markdown == _chandras_markdown(raw, images=images, headers=headers)
        assert result.markdown


def _small_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (280, 364), "white").save(buf, format="PNG")
    return buf.getvalue()


def test_request_max_tokens_fits_the_context() -> None:
    """The budget, cut to the room an upper estimate of the prompt leaves; with no room by
    the estimate (it is no guide), the budget as is."""
    from chandrad.ocr import request_max_tokens

    assert request_max_tokens(12384, 18000, 5000) == 12384
    assert request_max_tokens(12384, 18000, 7168) == 10832
    assert request_max_tokens(16, 4096, 4942) == 16
    assert request_max_tokens(12384, 611, 1087) == 611  # never above max_model_len
    assert request_max_tokens(12384, None, 5617) == 12384


def test_context_overflow_reads_vllms_400() -> None:
    from chandrad.ocr import context_overflow

    mineru = ("'max_tokens' or 'max_completion_tokens' is too large: 8192. This model's maximum "
              "context length is 8192 tokens and your request has 1210 input tokens "
              "(8192 > 8192 - 1210).")
    assert context_overflow(mineru) == (True, 1210)
    older = ("This model's maximum context length is 16384 tokens. However, you requested 19591 "
             "tokens (9591 in the messages, 10000 in the completion).")
    assert context_overflow(older) == (True, 9591)
    prompt_alone = ("This model's maximum context length is 4096 tokens. However, your prompt "
                    "contains 5000 input tokens, which exceeds this limit even without any "
                    "output tokens.")
    assert context_overflow(prompt_alone) == (False, None)
    assert context_overflow("simulated: the image could not be processed") == (False, None)
    vllm_032 = ("max_tokens=12384 cannot be greater than max_model_len=611. Please request "
                "fewer output tokens.")
    assert context_overflow(vllm_032) == (True, None)


def test_error_retry_delay_is_chandras() -> None:
    from chandrad.ocr import error_retry_delay

    assert [error_retry_delay(n) for n in (1, 2, 3)] == [2.0, 4.0, 6.0]
