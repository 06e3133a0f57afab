"""Figures of the searchable PDF output (docs/outputs.md): its size against the source,
the time it adds per page, and where poppler finds its text.

    .venv/bin/python bench/searchable_pdf.py [--out bench/results/searchable_pdf.json]

Two parts, both on this machine's CPU with the real ``render.searchable_pdf``:

1. **Corpus**: every corpus document chandrad processes (``expect`` ok: ``good/`` and the
   ``bad/`` files a careful reader still handles), each page given the
   blocks of a Chandra-style answer (parsed by chandra-ocr, as in
   tests/test_searchable_pdf.py): the PDF's size over the source's (median, worst) and the
   seconds it takes per page (the whole document once, as a render worker makes it).
2. **Placement**: the pages of the corpus's born-digital PDFs (up to ``--pages`` of each)
   rasterised at 150 dpi into image-only PDFs (a scan whose true text is known), each page
   given its own text blocks (PyMuPDF's ``get_text("dict")``, boxes and lines) as Chandra
   blocks. For each word of those blocks: found by ``pdftotext -layout`` (the block's lines
   in the page's text), inside its block's box by ``pdftotext -bbox``, and on the right
   line and on the word itself (the centre of poppler's box inside the born-digital
   word's box, grown by a quarter of its height): how far the estimated positions are
   from where the word is printed.

Relative paths only in what is written (the corpus by its ``tests/corpus`` path).
"""

# PyMuPDF ships partial annotations: many of its methods are untyped.
# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import argparse
import html
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pymupdf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chandrad import ocr, render, textlayer  # noqa: E402

CORPUS = REPO / "tests" / "corpus"
ANSWER = (
    '<div data-bbox="60 40 940 90" data-label="Section-Header"><h1>Quarterly report</h1></div>'
    '<div data-bbox="60 110 940 330" data-label="Text"><p>The committee met on Tuesday to '
    'review the budget for printing, postage and the archive of scanned letters.</p></div>'
    '<div data-bbox="60 350 940 520" data-label="Table"><table><tr><th>Item</th><th>Cost'
    '</th></tr><tr><td>Paper</td><td>12.50</td></tr></table></div>'
)


def _good() -> list[Path]:
    rows = (CORPUS / "MANIFEST.tsv").read_text(encoding="utf-8").splitlines()
    head = rows[0].split("\t")
    files = []
    for row in rows[1:]:
        cells = dict(zip(head, row.split("\t"), strict=False))
        if cells["expect"] == "ok":
            files.append(CORPUS / cells["file"])
    return files


def _shapes(path: Path) -> list[tuple[float, float]]:
    if render.probe(path, 5000).kind == "pdf":
        with pymupdf.open(path) as doc:
            return [(p.rect.width, p.rect.height) for p in doc]
    from PIL import Image

    with Image.open(path) as img:
        return [img.size] * (getattr(img, "n_frames", 1) if img.format == "TIFF" else 1)


def _layout(raw: str, index: int, w: float, h: float) -> textlayer.PageLayout:
    width, height = 1000, max(1, round(1000 * h / w))
    result = ocr.parse_page(raw, ocr.PageImage(index, width, height, b""),
                            include_images=True, include_headers_footers=True)
    return textlayer.PageLayout(width, height, result.blocks)


def corpus(tmp: Path) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for path in _good():
        layouts = [_layout(ANSWER, i, w, h) for i, (w, h) in enumerate(_shapes(path))]
        render.searchable_pdf(path, layouts, "skip")  # warm: imports, fonts
        t0 = time.perf_counter()
        data = render.searchable_pdf(path, layouts, "skip")
        seconds = time.perf_counter() - t0
        out = tmp / "out.pdf"
        out.write_bytes(data)
        subprocess.run(["qpdf", "--check", str(out)], check=True, capture_output=True)
        rows.append({"file": str(path.relative_to(REPO)), "pages": len(layouts),
                     "source_bytes": path.stat().st_size, "pdf_bytes": len(data),
                     "ratio": round(len(data) / path.stat().st_size, 3),
                     "ms_per_page": round(1000 * seconds / len(layouts), 2)})
    ratios = [r["ratio"] for r in rows]
    per_page = [r["ms_per_page"] for r in rows]
    worst = max(rows, key=lambda r: r["ratio"])
    return {"documents": len(rows), "pages": sum(r["pages"] for r in rows),
            "size_ratio_median": statistics.median(ratios),
            "size_ratio_worst": worst["ratio"], "size_ratio_worst_file": worst["file"],
            "ms_per_page_median": statistics.median(per_page),
            "ms_per_page_worst": max(per_page), "rows": rows}


def _words_of(pdf: Path) -> list[list[tuple[str, float, float, float, float]]]:
    out = subprocess.run(["pdftotext", "-bbox", str(pdf), "-"], check=True,
                         capture_output=True, text=True).stdout
    return [[(html.unescape(t), float(a), float(b), float(c), float(d)) for a, b, c, d, t
             in re.findall(r'<word xMin="([\d.]+)" yMin="([\d.]+)" xMax="([\d.]+)" '
                           r'yMax="([\d.]+)">([^<]*)</word>', page)]
            for page in out.split("<page ")[1:]]


def _true_blocks(page: pymupdf.Page) -> list[tuple[list[float], list[str],
                                                    list[tuple[str, pymupdf.Rect]]]]:
    """The page's text blocks as shown (after ``/Rotate``): box, lines, and each word
    with its printed box."""
    words = page.get_text("words")
    blocks = []
    for block in page.get_text("dict")["blocks"]:
        if block.get("type") != 0:
            continue
        lines = [" ".join("".join(s["text"] for s in line["spans"]).split())
                 for line in block["lines"]]
        lines = [line for line in lines if line]
        if not lines:
            continue
        turn = page.rotation_matrix  # extraction is in the unrotated page's space
        box = pymupdf.Rect(block["bbox"]) * turn
        inside = [(w[4], pymupdf.Rect(w[:4]) * turn) for w in words
                  if w[5] == block["number"]]
        blocks.append((list(box), lines, inside))
    return blocks


def placement(tmp: Path, max_pages: int) -> dict[str, Any]:
    totals = {"words": 0, "found_layout": 0, "in_block_box": 0, "on_word": 0, "on_line": 0}
    pages = 0
    for path in _good():
        if not path.name.startswith("digital_"):
            continue
        with pymupdf.open(path) as src:
            scan = pymupdf.open()
            layouts: list[textlayer.PageLayout] = []
            truths: list[list[tuple[list[float], list[str], list[Any]]]] = []
            for page in list(src)[:max_pages]:
                blocks = _true_blocks(page)
                if not blocks:
                    continue
                pix = page.get_pixmap(dpi=150, colorspace=pymupdf.csGRAY)
                new = scan.new_page(width=page.rect.width, height=page.rect.height)
                new.insert_image(new.rect, pixmap=pix)
                w, h = page.rect.width, page.rect.height
                raw = "".join(
                    f'<div data-bbox="{round(b[0] / w * 1000)} {round(b[1] / h * 1000)} '
                    f'{round(b[2] / w * 1000)} {round(b[3] / h * 1000)}" data-label="Text">'
                    + "".join(f"<p>{html.escape(line)}</p>" for line in lines) + "</div>"
                    for b, lines, _ in blocks)
                layout = _layout(raw, len(layouts), w, h)
                layouts.append(layout)
                # the boxes as the layer got them (Chandra's 0..1000 grid), in points
                sx, sy = w / layout.width, h / layout.height
                truths.append([([c["bbox"][0] * sx, c["bbox"][1] * sy, c["bbox"][2] * sx,
                                 c["bbox"][3] * sy], lines, words)
                               for c, (_, lines, words) in zip(layout.blocks, blocks,
                                                               strict=True)])
            if not layouts:
                continue
            scan_path = tmp / "scan.pdf"
            scan.save(scan_path)
            scan.close()
        out = tmp / "layered.pdf"
        out.write_bytes(render.searchable_pdf(scan_path, layouts, "skip"))
        texts = subprocess.run(["pdftotext", "-layout", str(out), "-"], check=True,
                               capture_output=True, text=True).stdout.split("\f")
        for page_words, page_text, blocks in zip(_words_of(out), texts, truths, strict=False):
            pages += 1
            flat = " ".join(page_text.split())
            used: set[int] = set()
            for box, lines, true_words in blocks:
                for line in lines:
                    n = len(line.split())
                    totals["words"] += n
                    if line in flat:
                        totals["found_layout"] += n
                for text, rect in true_words:
                    # poppler's box of the same word inside this block, nearest first
                    cands = [(i, w) for i, w in enumerate(page_words) if i not in used
                             and w[0] == text and box[0] - 0.5 <= w[1] and w[3] <= box[2] + 0.5
                             and box[1] - 0.5 <= w[2] and w[4] <= box[3] + 0.5]
                    if not cands:
                        continue
                    cx, cy = rect.x0 + rect.width / 2, rect.y0 + rect.height / 2
                    i, best = min(cands, key=lambda c: ((c[1][1] + c[1][3]) / 2 - cx) ** 2
                                  + ((c[1][2] + c[1][4]) / 2 - cy) ** 2)
                    used.add(i)
                    totals["in_block_box"] += 1
                    mx, my = (best[1] + best[3]) / 2, (best[2] + best[4]) / 2
                    grow = rect.height / 4
                    if rect.y0 - grow <= my <= rect.y1 + grow:
                        totals["on_line"] += 1
                        if rect.x0 - grow <= mx <= rect.x1 + grow:
                            totals["on_word"] += 1
    words = max(1, totals["words"])
    true_total = totals["words"]
    return {"pages": pages, "words": true_total,
            "found_by_pdftotext_layout": round(totals["found_layout"] / words, 4),
            "inside_block_box": round(totals["in_block_box"] / words, 4),
            "on_the_printed_line": round(totals["on_line"] / words, 4),
            "on_the_printed_word": round(totals["on_word"] / words, 4)}


def picture(tmp: Path, png: Path, source: Path, index: int = 0) -> None:
    """Page ``index`` of ``source`` rasterised, its own text blocks laid as the layer,
    then a copy with poppler's view of that layer made visible: each word
    ``pdftotext -bbox`` reports, boxed and written in red where a search would
    highlight it (the layer's own font has no shapes to show), rendered by pdftoppm."""
    with pymupdf.open(source) as src:
        page = src[index]
        blocks = _true_blocks(page)
        w, h = page.rect.width, page.rect.height
        scan = pymupdf.open()
        new = scan.new_page(width=w, height=h)
        new.insert_image(new.rect, pixmap=page.get_pixmap(dpi=150, colorspace=pymupdf.csGRAY))
        scan.save(tmp / "pic-scan.pdf")
        scan.close()
    raw = "".join(
        f'<div data-bbox="{round(b[0] / w * 1000)} {round(b[1] / h * 1000)} '
        f'{round(b[2] / w * 1000)} {round(b[3] / h * 1000)}" data-label="Text">'
        + "".join(f"<p>{html.escape(line)}</p>" for line in lines) + "</div>"
        for b, lines, _ in blocks)
    layout = _layout(raw, 0, w, h)
    layered = tmp / "pic-layered.pdf"
    layered.write_bytes(render.searchable_pdf(tmp / "pic-scan.pdf", [layout], "skip"))
    with pymupdf.open(layered) as doc:
        shown = doc[0]
        sx, sy = w / layout.width, h / layout.height
        for block in layout.blocks:
            x0, y0, x1, y1 = block["bbox"]
            shown.draw_rect(pymupdf.Rect(x0 * sx, y0 * sy, x1 * sx, y1 * sy),
                            color=(0, 0.4, 1), width=0.8)
        for text, x0, y0, x1, y1 in _words_of(layered)[0]:
            rect = pymupdf.Rect(x0, y0, x1, y1)
            shown.draw_rect(rect, color=(0.9, 0, 0), fill=(1, 0.85, 0.85), width=0.3,
                            fill_opacity=0.5)
            shown.insert_text((x0, y1 - rect.height * 0.25), text, fontsize=rect.height * 0.6,
                              color=(0.8, 0, 0), fontname="helv")
        doc.save(tmp / "pic-visible.pdf")
    # the upper part of the page at 90 dpi: legible, and small enough for the docs
    subprocess.run(["pdftoppm", "-r", "90", "-png", "-singlefile", "-f", "1",
                    "-x", "0", "-y", "0", "-W", str(round(w * 90 / 72)),
                    "-H", str(round(h * 0.5 * 90 / 72)),
                    str(tmp / "pic-visible.pdf"), str(png.with_suffix(""))], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--pages", type=int, default=5, help="placement: pages per PDF")
    parser.add_argument("--picture", type=Path, default=None,
                        help="write the page with its layer made visible here (PNG)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.picture:
            picture(Path(tmp), args.picture,
                    CORPUS / "good" / "digital_us-appeals-opinion_17p.pdf")
        result = {"corpus": corpus(Path(tmp)), "placement": placement(Path(tmp), args.pages)}
    summary = {k: v for k, v in result["corpus"].items() if k != "rows"}
    print(json.dumps({"corpus": summary, "placement": result["placement"]}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
