"""The memory plan: what fits before any engine starts, by vLLM 0.32's own accounting rules.

Owns the arithmetic from a model's shape (``config.json`` and the safetensors headers, read by
``chandrad/model_files.py``) and a memory budget to the KV cache vLLM will size at start, and
from it the largest ``max_num_seqs`` / ``max_num_batched_tokens`` / ``max_model_len`` that fit.
Pure: no I/O, no vLLM import. Each rule names the vLLM source it mirrors:

- KV bytes for the budget: on a GPU ``ceil(total × gpu_memory_utilization)`` minus weights, the
  profile run's activation peak and the runtime's own memory (``v1/worker/gpu_worker.py``,
  ``request_memory``); on the CPU exactly ``VLLM_CPU_KVCACHE_SPACE`` GiB (``platforms/cpu.py``),
  else ``--kv-cache-memory-bytes``.
- Block size: 128 on the CPU, 16 on a GPU unless given; a hybrid model raises it until one
  attention page holds one linear-attention (Mamba) state, in steps of the kernel block
  (``platforms/interface.py``, ``_align_hybrid_block_size``), and pads the state page to it.
- Groups: one group of every full-attention layer; a hybrid model's layers split into groups
  of ``min`` (or, when the larger count is < 1.5 × the smaller, ``max``) layers of one kind
  (``v1/core/kv_cache_utils.py``, ``_get_kv_cache_groups_uniform_page_size``). A block is one
  page of every layer of a group: ``bytes_per_block = group_size × page``, and
  ``num_blocks = kv_bytes // bytes_per_block``.
- A request at ``max_model_len`` takes ``ceil(len / block)`` blocks of each attention group
  and 1 block (2 with prefix caching's ``align`` mode) of each state group; vLLM logs
  ``max_concurrency = num_blocks / that`` and ``KV cache size = int(concurrency × len)``
  (``get_max_concurrency_for_kv_cache_config``, ``get_kv_cache_capacity``).

The activation peak is an estimate (the profile run is measured, not computed, by vLLM): the
largest live tensors of one decoder layer over ``max_num_batched_tokens`` tokens or of one
vision layer over the largest image's patches, plus the encoder output and the sampler's
float32 logits. It matters on a GPU only: the CPU's KV space is explicit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chandrad.config import MemoryConfig
    from chandrad.engine.profile import MemoryProfile

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
               "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
               "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1,
               "I32": 4, "I64": 8, "F64": 8, "BOOL": 1}
#: vLLM's default block size when not given: the CPU backend's, a GPU backend's (FlashAttention).
CPU_BLOCK_SIZE = 128
GPU_BLOCK_SIZE = 16
#: Smallest kernel block of the attention backend (CPU: MultipleOf(32); FlashAttention: 16).
CPU_KERNEL_BLOCK = 32
GPU_KERNEL_BLOCK = 16
#: What the GPU runtime holds besides weights, activations and KV (cuBLAS/NCCL workspaces and
#: captured CUDA graphs; eager: workspaces only). An assumption, not read from vLLM.
GPU_RUNTIME_BYTES = GIB
GPU_RUNTIME_EAGER_BYTES = 256 << 20
#: ``auto`` never lowers ``max_num_batched_tokens`` below this (the ladder's floor).
MIN_BATCHED_TOKENS = 512


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of one model (see ``model_shape``)."""

    dtype_bytes: int
    weights_bytes: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    full_attention_layers: int
    linear_attention_layers: int
    max_position_embeddings: int
    #: Linear-attention (Gated DeltaNet) state: conv channels × (kernel − 1), value heads ×
    #: value dim × key dim; the recurrent state's dtype ("auto": the model's).
    conv_state_elems: int = 0
    ssm_state_elems: int = 0
    ssm_dtype: str = "auto"
    vision_hidden: int = 0
    vision_intermediate: int = 0
    #: Patches of the largest image the processor lets through, and image tokens after merging.
    vision_patches_max: int = 0
    image_tokens_max: int = 0


@dataclass(frozen=True)
class Budget:
    """Where the KV cache comes from: an explicit size (CPU space, ``kv_cache_memory_bytes``)
    or a GPU's total × utilisation."""

    device: str  # "cpu" | "gpu"
    kv_cache_bytes: int | None = None
    gpu_total_bytes: int | None = None
    gpu_free_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    #: The CPU has AVX-512 BF16: vLLM keeps the linear-attention state in float32 there.
    cpu_avx512_bf16: bool = False


@dataclass(frozen=True)
class Request:
    """The engine flags the plan is for; ``None``: choose (``"auto"``)."""

    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    #: Tokens one page costs (prompt + image + answer): the length concurrency is judged at.
    page_tokens: int = 4096
    #: Upper bounds for ``auto``: vLLM's or Chandra's launch defaults.
    default_max_num_seqs: int = 256
    default_max_num_batched_tokens: int = 8192
    default_max_model_len: int | None = None


@dataclass(frozen=True)
class Plan:
    """The breakdown ``check-config --json`` shows as ``plan``."""

    device: str
    weights_bytes: int
    activation_peak_bytes: int
    runtime_bytes: int
    kv_budget_bytes: int
    block_size: int
    kv_bytes_per_token: int
    state_bytes_per_seq: int
    bytes_per_block: int
    num_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    fits: bool
    problem: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["max_concurrency"] = round(self.max_concurrency, 2)
        return out


def _dtype_bytes(name: str | None, default: int) -> int:
    return DTYPE_BYTES.get(str(name), default) if name not in (None, "auto") else default


def model_shape(config: Mapping[str, Any], weights_bytes: int,
                processor: Mapping[str, Any] | None = None,
                max_pixels: int | None = None) -> ModelShape:
    """The shape of a Hugging Face ``config.json`` (a VLM's ``text_config`` / ``vision_config``),
    its weights' bytes, and the largest image its ``processor`` config (or ``max_pixels``, the
    engine's ``mm_processor_kwargs``) lets through."""
    text = config.get("text_config") or config
    vision = config.get("vision_config") or {}
    dtype = text.get("dtype") or config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    heads = int(text.get("num_attention_heads", 1))
    hidden = int(text.get("hidden_size", 0))
    layers = int(text.get("num_hidden_layers", 0))
    types = text.get("layer_types")
    if isinstance(types, list) and "linear_attention" in types:
        linear = sum(1 for t in types if t == "linear_attention")
    else:
        linear = 0
    k_heads, v_heads = int(text.get("linear_num_key_heads", 0)), int(
        text.get("linear_num_value_heads", 0))
    k_dim, v_dim = int(text.get("linear_key_head_dim", 0)), int(
        text.get("linear_value_head_dim", 0))
    conv_dim = k_dim * k_heads * 2 + v_dim * v_heads
    patches, tokens = _largest_image(config, vision, processor or {}, max_pixels)
    return ModelShape(
        dtype_bytes=_dtype_bytes(dtype, 2), weights_bytes=weights_bytes, hidden_size=hidden,
        intermediate_size=int(text.get("intermediate_size", 4 * hidden)),
        vocab_size=int(text.get("vocab_size", config.get("vocab_size", 0))),
        num_heads=heads, num_kv_heads=int(text.get("num_key_value_heads", heads)),
        head_dim=int(text.get("head_dim") or hidden // max(heads, 1)),
        full_attention_layers=layers - linear, linear_attention_layers=linear,
        max_position_embeddings=int(text.get("max_position_embeddings", 8192)),
        conv_state_elems=conv_dim * (int(text.get("linear_conv_kernel_dim", 4)) - 1) if linear
        else 0,
        ssm_state_elems=v_heads * v_dim * k_dim if linear else 0,
        ssm_dtype=str(text.get("mamba_ssm_dtype") or "auto"),
        vision_hidden=int(vision.get("hidden_size", 0)),
        vision_intermediate=int(vision.get("intermediate_size", 0)),
        vision_patches_max=patches, image_tokens_max=tokens,
    )


def _largest_image(config: Mapping[str, Any], vision: Mapping[str, Any],
                   processor: Mapping[str, Any], max_pixels: int | None) -> tuple[int, int]:
    """Patches and image tokens of the largest image: Qwen-VL processors bound the pixels
    (``size.longest_edge`` is a pixel count there, or ``max_pixels``); Idefics3 cuts the
    resized image into ``max_image_size`` tiles plus one global tile."""
    patch = int(processor.get("patch_size") or vision.get("patch_size") or 14)
    size = processor.get("size") or {}
    if "merge_size" in processor or "spatial_merge_size" in vision:
        merge = int(processor.get("merge_size") or vision.get("spatial_merge_size") or 1)
        pixels = max_pixels or processor.get("max_pixels") or size.get("longest_edge") or 0
        patches = int(pixels) // (patch * patch)
        return patches, patches // (merge * merge)
    edge = int(size.get("longest_edge") or vision.get("image_size") or 0)
    tile = int((processor.get("max_image_size") or {}).get("longest_edge")
               or vision.get("image_size") or edge or 1)
    tiles = math.ceil(edge / tile) ** 2 + (1 if edge > tile else 0)
    per_tile = (tile // patch) ** 2
    scale = int(config.get("scale_factor", 1))
    return tiles * per_tile, tiles * per_tile // (scale * scale)


def _state_bytes(shape: ModelShape, budget: Budget) -> int:
    """One sequence's linear-attention state of one layer (vLLM's ``MambaSpec`` page)."""
    if not shape.linear_attention_layers:
        return 0
    ssm = shape.ssm_dtype
    if budget.device == "cpu" and budget.cpu_avx512_bf16 and ssm not in ("bfloat16", "float16"):
        ssm = "float32"  # platforms/cpu.py: "Reset SSM cache type to float32"
    return (shape.conv_state_elems * shape.dtype_bytes
            + shape.ssm_state_elems * _dtype_bytes(ssm, shape.dtype_bytes))


def block_size(shape: ModelShape, budget: Budget, requested: int | None) -> int:
    """vLLM's block size: the requested or the platform's, raised for a hybrid model until
    one attention page holds one state page."""
    cpu = budget.device == "cpu"
    size = requested or (CPU_BLOCK_SIZE if cpu else GPU_BLOCK_SIZE)
    state = _state_bytes(shape, budget)
    if state:
        kernel = CPU_KERNEL_BLOCK if cpu else GPU_KERNEL_BLOCK
        align = max(kernel, size)
        needed = align * math.ceil(state / (align * kv_bytes_per_token_layer(shape)))
        needed = kernel * math.ceil(needed / kernel)
        size = max(size, needed)
    return size


def kv_bytes_per_token_layer(shape: ModelShape) -> int:
    """K and V of one token in one full-attention layer."""
    return 2 * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes


def _groups(shape: ModelShape) -> tuple[int, int, int]:
    """(layers per group, attention groups, state groups)."""
    full, linear = shape.full_attention_layers, shape.linear_attention_layers
    if not linear:
        return full, 1, 0
    size = min(full, linear)
    if max(full, linear) < 1.5 * size:
        size = max(full, linear)
    return size, math.ceil(full / size), math.ceil(linear / size)


def activation_peak(shape: ModelShape, batched_tokens: int, seqs: int) -> int:
    """The profile run's peak beside the weights (an estimate, see the module docstring)."""
    d = shape.dtype_bytes
    layer = batched_tokens * d * (4 * shape.hidden_size + 3 * shape.intermediate_size
                                  + (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim)
    vision = shape.vision_patches_max * d * (6 * shape.vision_hidden
                                             + 2 * shape.vision_intermediate)
    encoder_out = shape.image_tokens_max * shape.hidden_size * d
    logits = 2 * seqs * shape.vocab_size * 4
    return max(layer, vision) + encoder_out + logits


def blocks_per_request(shape: ModelShape, length: int, size: int, prefix_caching: bool) -> int:
    """Blocks one request of ``length`` tokens holds across all groups."""
    _, attention, state = _groups(shape)
    return attention * math.ceil(length / size) + state * (2 if prefix_caching else 1)


def plan(shape: ModelShape, budget: Budget, request: Request) -> Plan:
    """The plan for ``request`` on ``budget``; ``auto`` keys are the largest that fit."""
    size = block_size(shape, budget, request.block_size)
    per_token_layer = kv_bytes_per_token_layer(shape)
    group_size, attention, state_groups = _groups(shape)
    bytes_per_block = group_size * size * per_token_layer
    seqs_wanted = request.max_num_seqs or request.default_max_num_seqs
    tokens = request.max_num_batched_tokens or request.default_max_num_batched_tokens
    length_wanted = (request.max_model_len or request.default_max_model_len
                     or shape.max_position_embeddings)
    activation = activation_peak(shape, tokens, seqs_wanted)
    runtime = 0
    if budget.device == "cpu" or budget.gpu_total_bytes is None:
        kv_bytes = budget.kv_cache_bytes or 0
    elif budget.kv_cache_bytes is not None:
        kv_bytes = budget.kv_cache_bytes
    else:
        runtime = GPU_RUNTIME_EAGER_BYTES if request.enforce_eager else GPU_RUNTIME_BYTES
        requested = math.ceil(budget.gpu_total_bytes * budget.gpu_memory_utilization)
        kv_bytes = requested - shape.weights_bytes - activation - runtime
        if request.max_num_batched_tokens is None:  # auto: shrink the batch before the KV
            while kv_bytes < bytes_per_block * 64 and tokens > MIN_BATCHED_TOKENS:
                tokens = max(MIN_BATCHED_TOKENS, tokens // 2)
                activation = activation_peak(shape, tokens, seqs_wanted)
                kv_bytes = requested - shape.weights_bytes - activation - runtime
    num_blocks = max(kv_bytes, 0) // bytes_per_block
    usable = max(num_blocks - 1, 0)  # BlockPool keeps one null block
    fit_len = _longest(shape, usable, size, request.enable_prefix_caching)
    length = length_wanted if request.max_model_len else min(length_wanted, fit_len)
    per_request = blocks_per_request(shape, length, size, request.enable_prefix_caching)
    concurrency = num_blocks / per_request if per_request else 0.0
    per_page = blocks_per_request(shape, min(request.page_tokens, length or length_wanted),
                                  size, request.enable_prefix_caching)
    seqs = seqs_wanted if request.max_num_seqs else max(1, min(seqs_wanted, usable // per_page))
    problem = None
    if num_blocks <= blocks_per_request(shape, 1, size, request.enable_prefix_caching):
        need = shape.weights_bytes + activation + runtime + bytes_per_block * per_page
        problem = (f"no room for the KV cache: {kv_bytes / GIB:.2f} GiB left" + (
            f"; a {min(request.page_tokens, length_wanted)}-token page needs "
            f"gpu_memory_utilization {need / budget.gpu_total_bytes:.2f}"
            if budget.device == "gpu" and budget.gpu_total_bytes else ""))
    elif budget.device == "cpu" and size % CPU_KERNEL_BLOCK:
        problem = (f"block_size {size}: the CPU attention kernels take multiples of "
                   f"{CPU_KERNEL_BLOCK} (vLLM sizes the cache, then its workers fail)")
    elif fit_len < length:
        problem = (f"max_model_len {length} needs {per_request} KV blocks; "
                   f"{usable} fit (longest that fits: {fit_len})")
    if budget.device == "gpu" and budget.gpu_free_bytes is not None and \
            budget.gpu_total_bytes is not None and budget.kv_cache_bytes is None and \
            budget.gpu_free_bytes < budget.gpu_total_bytes * budget.gpu_memory_utilization:
        problem = problem or (f"only {budget.gpu_free_bytes / GIB:.2f} GiB free of the "
                              f"{budget.gpu_total_bytes * budget.gpu_memory_utilization / GIB:.2f}"
                              " GiB that gpu_memory_utilization asks for")
    return Plan(
        device=budget.device, weights_bytes=shape.weights_bytes,
        activation_peak_bytes=activation if budget.device == "gpu" else 0,
        runtime_bytes=runtime, kv_budget_bytes=max(kv_bytes, 0), block_size=size,
        kv_bytes_per_token=per_token_layer * shape.full_attention_layers,
        state_bytes_per_seq=_state_bytes(shape, budget) * shape.linear_attention_layers,
        bytes_per_block=bytes_per_block, num_blocks=num_blocks,
        kv_cache_tokens=int(concurrency * length), max_concurrency=concurrency,
        max_num_seqs=seqs, max_num_batched_tokens=tokens, max_model_len=length,
        fits=problem is None, problem=problem,
    )


def _longest(shape: ModelShape, usable_blocks: int, size: int, prefix_caching: bool) -> int:
    """The longest request whose blocks fit in ``usable_blocks`` (0: none)."""
    _, attention, state = _groups(shape)
    left = usable_blocks - state * (2 if prefix_caching else 1)
    return max(left // attention, 0) * size if attention else shape.max_position_embeddings


def avx512_bf16(cpuinfo: str) -> bool:
    """Whether ``/proc/cpuinfo``'s text lists the ``avx512_bf16`` flag."""
    return any(line.startswith("flags") and "avx512_bf16" in line.split()
               for line in cpuinfo.splitlines())


def vllm_defaults(device: str, gpu_total_bytes: int | None) -> tuple[int, int]:
    """vLLM 0.32's API-server defaults ``(max_num_batched_tokens, max_num_seqs)``
    (``engine/arg_utils.py``): CPU 2048/128; GPU ≥ 160 GiB 16384/1024, ≥ 70 GiB 8192/1024,
    else 2048/256."""
    if device == "cpu" or gpu_total_bytes is None:
        return 2048, 128
    if gpu_total_bytes >= 160 * GIB:
        return 16384, 1024
    if gpu_total_bytes >= 70 * GIB:
        return 8192, 1024
    return 2048, 256


def plan_engine(shape: ModelShape, memory: MemoryConfig, profile: MemoryProfile, *,
                env: Mapping[str, str], gpu_total_bytes: int | None = None,
                gpu_free_bytes: int | None = None, cpu_avx512_bf16: bool = False,
                page_tokens: int = 4096) -> Plan:
    """The plan for the engine chandrad would start: ``profile`` (``"auto"`` resolved) bounds
    the keys ``memory`` leaves ``"auto"``, which the plan then fits; configured keys are kept
    and judged. Without a GPU the budget is ``VLLM_CPU_KVCACHE_SPACE`` of the engine's ``env``
    (else ``kv_cache_memory_bytes``)."""
    return plan(shape, *engine_inputs(
        memory, profile, env=env, gpu_total_bytes=gpu_total_bytes,
        gpu_free_bytes=gpu_free_bytes, cpu_avx512_bf16=cpu_avx512_bf16,
        page_tokens=page_tokens))


def engine_inputs(memory: MemoryConfig, profile: MemoryProfile, *,
                  env: Mapping[str, str], gpu_total_bytes: int | None = None,
                  gpu_free_bytes: int | None = None, cpu_avx512_bf16: bool = False,
                  page_tokens: int = 4096) -> tuple[Budget, Request]:
    """The budget and request :func:`plan_engine` plans (see there)."""
    device = "gpu" if gpu_total_bytes is not None else "cpu"
    space = env.get("VLLM_CPU_KVCACHE_SPACE", "")
    explicit = profile.kv_cache_memory_bytes
    if device == "cpu" and space.strip().isdigit():
        explicit = int(space) * GIB
    budget = Budget(device, kv_cache_bytes=explicit, gpu_total_bytes=gpu_total_bytes,
                    gpu_free_bytes=gpu_free_bytes,
                    gpu_memory_utilization=profile.gpu_memory_utilization or 0.9,
                    cpu_avx512_bf16=cpu_avx512_bf16)
    tokens, seqs = vllm_defaults(device, gpu_total_bytes)

    def given(key: str) -> int | None:
        value = getattr(memory, key)
        return None if value in ("auto", None) else int(value)

    request = Request(
        max_model_len=given("max_model_len"), max_num_seqs=given("max_num_seqs"),
        max_num_batched_tokens=given("max_num_batched_tokens"),
        block_size=profile.block_size, enforce_eager=profile.enforce_eager,
        page_tokens=page_tokens,
        default_max_num_seqs=profile.max_num_seqs or seqs,
        default_max_num_batched_tokens=profile.max_num_batched_tokens or tokens,
        default_max_model_len=profile.max_model_len)
    return budget, request
