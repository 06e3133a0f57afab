"""The failure classifier: vLLM output lines + exit status → :class:`Diagnosis`.

The classes, their evidence and remedies: docs/operations.md, Failure classes.

Pure: no I/O, no clock, no globals that change. Used by the engine supervisor
(incrementally, through :class:`LineScanner`) and by ``chandractl diagnose``.

How it decides, in order of strength:

1. Each line is cleaned (ANSI colours, HTML colour tags, timestamps, the
   ``(EngineCore_DP0 pid=..)`` / ``(VllmWorker rank=0 pid=..)`` process tags,
   ``LEVEL date [file.py:N]`` headers, quote bars, a log multiplexer's name column such as
   docker compose's ``vllm  | ``, syslog/journalctl and dmesg prefixes) and its log level
   noted. A line logged at INFO, DEBUG or WARNING never proves a failure: vLLM prints
   plenty of benign lines that mention memory, KV cache and even OOM hints.
2. vLLM's own failure messages (templates in ``vllm/v1/core/kv_cache_utils.py``,
   ``vllm/v1/worker/utils.py``, ``gpu_worker.py``, ``gpu_model_runner.py``,
   ``vllm/config/compilation.py``, and V0's ``worker/worker.py``) name their class
   directly: a hybrid model's ``max_num_seqs`` above its Mamba cache blocks (checked
   first: it runs after the KV cache was sized, so it is the cause whatever KV lines
   precede it; before vLLM had that check, 0.17.x, the Mamba conv kernel's bare ``assert
   num_cache_lines >= batch`` during CUDA graph capture, with no figures), KV cache
   insufficient, free memory below the requested utilisation, memory profiling error, OOM
   while warming up / loading. A KV message cut off by the
   paste is still known by the frame that raises it (``_check_enough_kv_cache_memory``,
   ``raise_if_cache_size_invalid``) or by V0's INFO line just before it (``# GPU blocks:
   0``, a negative KV budget).
3. A device OOM, in any of its wordings (PyTorch's caching-allocator message old and new,
   ``torch.OutOfMemoryError``, driver ``CUDA_ERROR_OUT_OF_MEMORY``, runtime
   ``cudaErrorMemoryAllocation`` / "CUDA runtime error (2) : out of memory", "CUDA driver
   error: out of memory", Triton's "Triton Error [CUDA]: out of memory", vLLM's CUDACHECK
   "Cuda error <file>:<line> 'out of memory'", cuBLAS/cuDNN/NCCL allocation failures, a
   per-process fraction's "would exceed allowed memory", and a message the paste cut off on
   its last line, "CUDA out of"), is ``fragmentation`` when the allocator's own figures say
   so (reserved-but-unallocated U ≥ requested R and U ≥ 256 MiB, or U ≥ 1 GiB), otherwise
   ``cuda_oom_runtime`` or ``cuda_oom_load`` by phase. The phase is the readiness history
   when there is one; in a pasted excerpt it is inferred from the frames and messages around
   the error: start-up work (weights loading, profile run, ``determine_available_memory``,
   KV cache allocation, warm-up, CUDA graph capture, V0's ``CacheEngine``) against the
   serving loop (``run_busy_loop``, V0's ``run_engine_loop``/``_log_task_completion``,
   sleep-mode ``wake_up``, request handlers, throughput lines, SGLang's scheduler lines, a
   request or session id in the failure's own line, a failure stated against a request or a
   generation, a caller's generate loop). With both present the marker nearest the error
   wins; with neither, V1's ``execute_model``, the sampler, the sleep-mode allocator or the
   reporter's own script calling generate (all mostly serving work) tips it to runtime, and
   so does a model forward in a paste from a stack other than vLLM (vLLM's start-up profile
   run runs it too). The allocator's figures are read from the whole message even when the
   paste hard-wrapped it. An OOM reported *through* NCCL ("Cuda failure 'out of memory'") is
   a device allocation failure, not a communication fault: restarting with the same memory
   settings would fail the same way, so it joins the OOM classes (subclass ``nccl_oom``) and
   gets the same remedies.
4. Host memory exhaustion (kernel OOM killer, also by its task table alone or by its kill
   line, systemd-oomd, Ray's memory monitor in each shape it reports a kill in: the task's
   error, the worker's NODE_OUT_OF_MEMORY exit type, the kill summary, the top-memory-users
   table, the suggestions that end its report; "Killed", a shell's
   "line N: PID Killed", exit 137/-9, ``DefaultCPUAllocator``, ``MemoryError``, ENOMEM
   "Cannot allocate memory") is ``host_oom``. A C++ ``std::bad_alloc`` on its own is not
   (a corrupt or overflowed size fails the same way; it is a crash), nor is ENOMEM from
   registering RDMA memory (a locked-memory limit) or a request no host has (≥ 16 TiB, a
   negative size read as unsigned). A bare SIGKILL counts only when nothing else
   explains the death and nobody was stopping the engine on purpose. A memory cause that a
   message only offers as a possibility (after a hedge word such as "potential root causes",
   "likely", "if", or as one item of an enumeration "(1) … (2) …") is never a memory verdict,
   for host and device memory alike.
5. Other fatal errors (NCCL, illegal memory access, ECC/Xid, driver mismatch,
   address in use, model not found, unsupported architecture, no device, kernel
   resources, other CUDA errors, crashes, a dead engine core, any other final
   exception, a traceback in CPython's, IPython's, rich's or native form even when its
   exception line was cut, a panic, a non-zero exit status) are ``other_fatal`` with a finer
   ``subclass``; a non-zero exit with no evidence at all is ``other_fatal``/``exited``.
   vLLM's start-up checks of one budget against another (``max_num_batched_tokens`` below
   ``max_model_len`` or ``max_num_seqs``, an image's tokens above ``max_num_batched_tokens``,
   external weights above the utilisation) name their settings and are not restartable. A
   request the API server rejected as invalid (an image above the encoder cache) is no
   failure of the engine.

Measured on real excerpts from public issue threads and on vLLM's own templates at the pinned
and the newest release: tests/fixtures/classify/README.md.
"""

from __future__ import annotations

import html
import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class FailureClass(StrEnum):
    """The failure classes (docs/operations.md, Failure classes)."""

    CUDA_OOM_LOAD = "cuda_oom_load"
    KV_CACHE_INSUFFICIENT = "kv_cache_insufficient"
    FRAGMENTATION = "fragmentation"
    GPU_MEMORY_UTILIZATION_TOO_HIGH = "gpu_memory_utilization_too_high"
    CUDA_OOM_RUNTIME = "cuda_oom_runtime"
    HOST_OOM = "host_oom"
    #: vLLM refused max_num_seqs above its pool of Mamba-state blocks (hybrid models).
    MAMBA_CACHE_INSUFFICIENT = "mamba_cache_insufficient"
    #: Requests in flight and no progress for engine.progress_timeout (found by the
    #: supervisor, not in the engine's lines).
    ENGINE_HUNG = "engine_hung"
    #: The engine exited with status 0 without being asked to and named no failure
    #: (engine/generation.py; a non-zero status is other_fatal/exited).
    ENGINE_EXITED = "engine_exited"
    OTHER_FATAL = "other_fatal"
    NONE = "none"


@dataclass(frozen=True)
class Diagnosis:
    """The verdict: class, the one line that proves it, the figures it gives, the remedy."""

    cls: FailureClass
    evidence: str = ""
    numbers: dict[str, float] = field(default_factory=dict)
    action: str = ""
    restartable: bool = True
    subclass: str = ""

    def to_dict(self) -> dict[str, object]:
        """The ``chandractl diagnose --json`` shape (plus restartable/subclass)."""
        return {
            "v": 1,
            "class": self.cls.value,
            "evidence": self.evidence,
            "action": self.action,
            "numbers": dict(self.numbers),
            "restartable": self.restartable,
            "subclass": self.subclass,
        }


# --------------------------------------------------------------------------- cleaning

_ANSI = re.compile(r"(?:\x1b|\^\[)\[[0-9;?]*[A-Za-z]|(?<![\w\]])\[[0-9]{1,3}(?:;[0-9]{1,3})*m")
_HTML_TAG = re.compile(r"</?(?:font|b|i|u|span|strong|em|code|pre)\b[^>]*>", re.IGNORECASE)
_TRAILER = re.compile(r"(?:\s*\[repeated \d+x across cluster\])+|\^M|\r")
_LEVELS = {
    "DEBUG": "DEBUG",
    "INFO": "INFO",
    "WARNING": "WARNING",
    "WARN": "WARNING",
    "ERROR": "ERROR",
    "CRITICAL": "ERROR",
    "FATAL": "ERROR",
    "W": "WARNING",
    "I": "INFO",
    "E": "ERROR",
    "F": "ERROR",
}
# Leading decorations, stripped repeatedly. Group "lvl" records a log level; when a line
# carries several (a log collector's severity before the process's own: GKE's "INFO 2025-…Z
# [resource.labels.containerName: vllm] … ERROR …"), the innermost, the process's, wins.
# Then the name column that log multiplexers put before every line: docker compose's
# service ("vllm  | ", "intel-gpu-vllm  | "), FastChat's stream ("... | ERROR | stderr | ");
# syslog's and journalctl's "Aug 17 18:42:18 host unit[pid]: "; dmesg's "[12345.678]" and
# "dmesg -T"'s bracketed date in any language; a bracketed tag that a launcher or collector
# puts before each line ("[Stage-2] ", "[worker-3] ", "[resource.labels.containerName: vllm] ").
_PREFIX = re.compile(
    r"""^(?:
        \s+
      | [▎│┃|>*]+
      | \[\d{4}-\d\d-\d\d[T ][\d:.,]+Z?\]
      | \d{4}-\d\d-\d\d[T ][\d:.,]+(?:Z|[+-]\d\d:?\d\d)?
      | \[(?P<lvl1>Error|Warning|Info|Debug)\]
      | \((?:[A-Za-z_][\w.:-]*)(?:[\s,]+(?:pid|rank|ip|tid|node)=[\w.:-]+)+\)
      | \((?:Process|pid=\d+)\)
      | \[rank\d+\]:
      | \[(?P<lvl2>[WEIF])\s?[^\]]*?\]
      | (?P<lvl3>DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\b:?
        (?:\s+\d\d-\d\d\s+[\d:.]+)?(?:\s+\d+(?=\s))?(?:\s+\[?[\w./<>-]+\.py:\d+\])?
      | \[?[\w./<>-]+\.py:\d+\]
      | [A-Za-z][\w.-]*\s+\|(?=\s|$)
      | [A-Z][a-z]{2}\s+\d{1,2}\s\d\d:\d\d:\d\d(?=\s)
      | [\w.-]+\s[\w.@/-]+\[\d+\]:
      | \[\s*\d+\.\d+\]
      | \[[^\]\n]{0,24}\d\d:\d\d:\d\d[^\]\n]{0,12}\]
      | \[[A-Za-z][\w.-]*(?::\s*[\w.-]+)?\](?=\s)
    )""",
    re.VERBOSE,
)


@dataclass(frozen=True)
class _Line:
    raw: str  # without ANSI/CR, stripped: what we quote as evidence
    text: str  # without prefixes
    level: str  # "", DEBUG, INFO, WARNING, ERROR

    @property
    def benign_level(self) -> bool:
        return self.level in ("DEBUG", "INFO", "WARNING")


def _clean(line: str) -> _Line:
    raw = _TRAILER.sub("", _ANSI.sub("", line))
    raw = html.unescape(_HTML_TAG.sub("", raw)).strip()
    text = raw
    level = ""
    for _ in range(12):
        m = _PREFIX.match(text)
        if not m or m.end() == 0:
            break
        lvl = m.group("lvl1") or m.group("lvl2") or m.group("lvl3")
        if lvl:
            level = _LEVELS.get(lvl.upper(), _LEVELS.get(lvl, "")) or level
        text = text[m.end() :]
    return _Line(raw=raw, text=text.strip(), level=level)


# --------------------------------------------------------------------------- numbers

_SIZE = r"(\d[\d,]*(?:\.\d+)?|\.\d+)\s*(bytes|B|KiB|KB|kB|MiB|MB|GiB|GB|TiB|TB)\b"
_UNIT_GIB = {
    "bytes": 1 / 2**30,
    "b": 1 / 2**30,
    "kib": 1 / 2**20,
    "kb": 1 / 2**20,
    "mib": 1 / 2**10,
    "mb": 1 / 2**10,
    "gib": 1.0,
    "gb": 1.0,  # vLLM and PyTorch print "GB" for 2**30 bytes in older releases
    "tib": 2**10,
    "tb": 2**10,
}


def _gib(value: str, unit: str) -> float:
    return round(float(value.replace(",", "")) * _UNIT_GIB[unit.lower()], 6)


def _size_after(pattern: str, text: str) -> float | None:
    m = re.search(pattern + r"\s*" + _SIZE, text, re.IGNORECASE)
    return _gib(m.group(1), m.group(2)) if m else None


def _size_before(pattern: str, text: str) -> float | None:
    m = re.search(_SIZE + r"\s*" + pattern, text, re.IGNORECASE)
    return _gib(m.group(1), m.group(2)) if m else None


def _int_after(pattern: str, text: str) -> float | None:
    m = re.search(pattern + r"\s*\(?\s*(\d[\d,]*)", text, re.IGNORECASE)
    return float(m.group(1).replace(",", "")) if m else None


def _put(numbers: dict[str, float], key: str, value: float | None) -> None:
    if value is not None and key not in numbers:
        numbers[key] = value


def _oom_numbers(text: str) -> dict[str, float]:
    """Figures of a PyTorch caching-allocator OOM message (new and pre-2.1 formats)."""
    n: dict[str, float] = {}
    _put(n, "requested_gib", _size_after(r"(?:Tried|trying) to allocate", text))
    _put(n, "total_gib", _size_after(r"total capacity of", text))
    _put(n, "free_gib", _size_after(r"total capacity of [\d.,]+\s*\w+ of which", text))
    _put(n, "in_use_gib", _size_after(r"(?:this process|Process \d+) has", text))
    _put(n, "allocated_gib", _size_after(r"Of the allocated memory", text))
    _put(n, "private_pools_gib", _size_after(r"allocated by PyTorch, with", text))
    _put(n, "allowed_gib", _size_before(r"allowed;", text))
    unallocated = _size_before(r"is reserved by PyTorch but unallocated", text)
    _put(n, "reserved_unallocated_gib", unallocated)
    # Pre-2.1: "(GPU 0; 15.78 GiB total capacity; 14.56 GiB already allocated;
    #           3.44 MiB free; 14.73 GiB reserved in total by PyTorch)"
    _put(n, "total_gib", _size_before(r"total capacity", text))
    _put(n, "allocated_gib", _size_before(r"already allocated", text))
    _put(n, "free_gib", _size_before(r"free\s*;", text))
    reserved = _size_before(r"reserved in total by PyTorch", text)
    if reserved is not None:
        n["reserved_gib"] = reserved
        if "allocated_gib" in n and "reserved_unallocated_gib" not in n:
            n["reserved_unallocated_gib"] = round(max(reserved - n["allocated_gib"], 0.0), 6)
    return n


def _is_fragmentation(n: dict[str, float]) -> bool:
    u = n.get("reserved_unallocated_gib")
    if u is None:
        return False
    r = n.get("requested_gib")
    return u >= 1.0 or (r is not None and u >= r and u >= 0.25)


# --------------------------------------------------------------------------- evidence

_I = re.IGNORECASE

# vLLM's own failure messages.
_KV_NO_MEMORY = re.compile(
    r"No available memory for the cache"
    # SGLang, where chandrad's engine may be wrapped: the same condition in its words.
    r"|(?:no|not enough) (?:GPU |device )?memory (?:left )?for (?:the )?KV cache"
    r"|Not enough memory\. Please try to increase --mem-fraction-static"
    # vLLM's auto-fit of max_model_len with no room for one token; the CPU backend's worker
    # whose own footprint fills its reservation ("… leaving none for the KV cache").
    r"|Cannot auto-fit max_model_len: not enough (?:GPU |device )?memory"
    r"|leaving none for the KV cache",
    _I,
)
_KV_MAX_SEQ = re.compile(
    # "model's", "models's" (0.8.x) and "model s" after a paste mangled the quote.
    r"To serve at least one request with the models?'?s? max seq len"
    r"|KV cache is needed, which is larger than the available KV cache memory"
    r"|max seq len \(\d[\d,]*\) is larger than the maximum number of tokens that can be stored"
    r"|larger than the maximum number of tokens that can be stored in KV cache"
    r"|estimated maximum model length is \d",
    _I,
)
# The frames that raise only the KV-cache errors: enough when the paste cut the message off.
_KV_FRAMES = re.compile(r"\b_?check_enough_kv_cache_memory\b|\braise_if_cache_size_invalid\b", _I)
# V0 logs the block count (INFO) just before raising: zero blocks, a negative KV budget or
# room for less than one request is the same failure even when the traceback was cut.
_KV_INFO = re.compile(
    r"# (?:GPU|CUDA) blocks: 0\b"
    r"|reserved for KV Cache is -\d"
    r"|Available KV cache memory: -\d"
    r"|Maximum concurrency for [\d,]+ tokens per request: 0\.\d+x",
    _I,
)
# Hybrid models (Mamba / Gated DeltaNet layers): vLLM refuses max_num_seqs above its pool of
# Mamba-state blocks (vllm/config/compilation.py, since vllm-project/vllm#38270). Raised in
# a worker, it is quoted again by the executor ("Worker failed with error 'max_num_seqs …'").
# Its second sentence, for a paste that lost the first: looked for only when no line holds
# (or a hard wrap splits) the first.
_MAMBA = re.compile(r"exceeds available Mamba cache\s+blocks", _I)
_MAMBA_TAIL = re.compile(r"Each decode sequence requires one Mamba cache block", _I)
# Before that check (vLLM 0.17.x, the pinned release) the same condition fails CUDA graph
# capture inside the Mamba conv kernel's bare assertion, with no figures: the decode batch
# (up to max_num_seqs) has more sequences than the pool has Mamba-state blocks ("cache lines").
_MAMBA_ASSERT = re.compile(r"assert num_cache_lines >= batch\b")
_GMU = re.compile(
    r"Free memory on device.{0,80}?on startup\s+is less than"
    r"|Error in memory profiling"
    r"|less than desired GPU memory utilization"
    # The CPU backend's equivalent: the NUMA node's free memory below the KV cache's share.
    r"|on kv cache\s+allocation is less than requested memory for kv",
    _I,
)
_LOAD_OOM_VLLM = re.compile(
    r"Failed to load model - not enough GPU memory"
    r"|out of memory (?:occurred when|while) (?:warming up|profiling|capturing)"
    r"|not enough (?:GPU|device) memory to load",
    _I,
)
_DEVICE_OOM = re.compile(
    r"(?:CUDA|HIP|XPU|NPU|MPS|GPU|device)\s+(?:error:?\s*|backend\s+)?out of memory"
    # Driver/runtime/allocator wordings: "CUDA driver error: out of memory", "CUDA runtime
    # error (2) : out of memory", "CUDA failed with error out of memory", "CUDA Error: out
    # of memory at .../cumem_allocator.cpp", "cudaError error: 2 (out of memory)",
    # "cudaMalloc failed: out of memory".
    r"|\b(?:CUDA|HIP|cuda\w*|hip\w*)\b[^\n]{0,40}?\b(?:error|failed|failure)\b[^\n]{0,24}?"
    r"\bout of memory\b"
    # The same with any word before the colon ("CUDA runtime erroe : out of memory").
    r"|\b(?:CUDA|HIP)\b[\w ]{0,24}:\s*out of memory\b"
    r"|OutOfMemoryError"
    r"|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY"
    r"|hipErrorOutOfMemory"
    r"|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|HIPBLAS_STATUS_ALLOC_FAILED"
    r"|Cuda failure (?:\d+ )?'?out of memory|Failed to CUDA (?:c|m)alloc"
    # Triton's driver ("Triton Error [CUDA]: out of memory", "Triton Error [HIP]:  Code: 2,
    # Messsage: out of memory") and vLLM's CUDACHECK ("Failed: Cuda error /x/y.cuh:307 'out of
    # memory'"): the driver's error string after a file, a code or a tag.
    r"|\bError \[(?:CUDA|HIP)\]:[^\n]{0,40}?\bout of memory\b"
    r"|\bCuda error \S+:\d+ '?out of memory"
    # PyTorch with a per-process memory fraction set.
    r"|Allocation on device \d+ would exceed allowed memory"
    r"|\bOOM\b.*(?:Tried|trying) to allocate"
    r"|Tried to allocate .*(?:total capacity|reserved by PyTorch)",
    _I,
)
# The paste stopped inside an out-of-memory message ("RuntimeError: CUDA out of",
# "torch.OutOfMe"): checked on the last line of the text only.
_DEVICE_OOM_CUT = re.compile(
    r"\b(?:CUDA|HIP|XPU|NPU)(?: (?:driver |runtime )?error:?)?"
    r" ou(?:t(?: (?:o(?:f(?: m\w*)?)?)?)?)?$"
    r"|\bOutOfMe\w*$",
    _I,
)
_NCCL_CONTEXT = re.compile(r"NCCL|Cuda failure", _I)
# Ray's OutOfMemoryError is about the *host* running out of RAM.
# Its memory monitor reports a kill in several shapes, each printed only once it has killed:
# the task's error ("Task was killed due to the node running low on memory"), the worker's
# exit type (NODE_OUT_OF_MEMORY), the periodic summary ("N Workers (tasks / actors) killed due
# to memory pressure (OOM)", not with N = 0), the top-memory-users table that follows a kill
# and the suggestions that end it ("Refer to the documentation on how to address the out of
# memory issue: …ray-oom-prevention…").
_RAY_HOST_OOM = re.compile(
    r"ray\.exceptions\.OutOfMe|\bRayOutOfMemoryError\b|node (?:is )?running low on memory"
    r"|Memory on the node .* was .* (?:when|exceeds the memory usage threshold)"
    r"|Ray killed this worker|(?<!\b0 Workers \(tasks / actors\) )"
    r"(?<!\b0 Workers )killed due to memory pressure"
    r"|exit type:? NODE_OUT_OF_MEMORY\b"
    r"|how to address the out of memory issue|ray-oom-prevention"
    r"|\bTop \d+ memory users\b|^PID\s+MEM\(GB\)\s+COMMAND\b",
    _I,
)
# A row of that table ("8800  1.18  ray::ReferenceModelRayActor"): pid, GB, a Ray worker's
# command. Two rows or more are the memory monitor's report even when the rest was cut.
_RAY_TOP_ROW = re.compile(r"^\d+\s+\d+(?:\.\d+)?\s+ray::\S")
_HOST_OOM = re.compile(
    r"Out of memory: Kill(?:ed)? process|Out of memory and no killable processes"
    # The kernel's second line of a kill, when the first was cut.
    r"|\bKilled process \d+ \([^)]*\) total-vm:"
    # systemd-oomd: "Killed /user.slice/x.scope due to memory pressure for …" / "memory used".
    r"|\bKilled /\S+ due to memory (?:pressure|used)\b"
    r"|oom[-_]kill|oom_reaper|Memory cgroup out of memory"
    r"|DefaultCPUAllocator: (?:can't allocate memory|not enough memory)"
    r"|^MemoryError\b"
    r"|Cannot allocate memory"
    r"|killed by (?:the )?(?:\S+ ){0,3}OOM[- ]?killer"
    # Kubernetes' "Reason: OOMKilled" and docker inspect's "OOMKilled": true, but not the
    # "OOMKilled": false that docker inspect prints for every container that was not killed.
    r"|\bOOMKilled\b(?!\"?\s*[:=]\s*(?:false|0)\b)"
    # The header of the task table the kernel dumps when its OOM killer runs.
    r"|Tasks state \(memory values in pages\)|\btotal_vm\s+rss\b.*\boom_score_adj\b",
    _I,
)
# Host-allocation failures that do not show the host's RAM running out, so a host_oom remedy
# (a smaller profile) would not help: C++'s std::bad_alloc, also as pybind11's "MemoryError:
# std::bad_alloc" (operator new fails for a corrupt or overflowed size as much as for a full
# host, and with Linux's overcommit a full host usually meets the OOM killer first); ENOMEM
# from registering RDMA memory (NCCL's "Call to ibv_reg_mr failed with error Cannot allocate
# memory", NET/IB), a locked-memory limit; and a request no host has (a negative size read as
# unsigned: "you tried to allocate 18446744073709551600 bytes").
_NOT_HOST_RAM = re.compile(
    r"^MemoryError:\s*std::bad_alloc\b|\bibv_\w+|\bNET/IB\b|\bRDMA\b|\bmemlock\b|\bmlx\d_",
    _I,
)
_HOST_REQUEST = re.compile(
    r"(?:tried to allocate|unable to mmap|allocate|allocating)\s+(-\d+|\d{10,})\s*bytes", _I
)
#: Bytes no host has (16 TiB): a request this large is a bogus size, not a full host.
_ABSURD_HOST_REQUEST = 1 << 44


# A process's own allocation failure (as opposed to the kernel's, oomd's or Ray's report of
# a kill): logged at WARNING or below, the process handled it (a fallback), so it is no verdict.
_PROCESS_ALLOC_FAILURE = re.compile(
    r"Cannot allocate memory|DefaultCPUAllocator|^MemoryError\b", _I
)


def _not_host_ram(text: str) -> bool:
    """Does this host-memory wording come from something other than the host's RAM running
    out (a locked-memory limit, RDMA registration, an impossible size)?"""
    if _NOT_HOST_RAM.search(text):
        return True
    m = _HOST_REQUEST.search(text)
    return m is not None and not 0 <= int(m.group(1)) < _ABSURD_HOST_REQUEST


def _not_host_oom_line(ln: _Line) -> bool:
    """:func:`_not_host_ram`, or a process's allocation failure it logged as handled."""
    return _not_host_ram(ln.text) or (
        ln.benign_level
        and _PROCESS_ALLOC_FAILURE.search(ln.text) is not None
        and _HOST_OOM.search(_PROCESS_ALLOC_FAILURE.sub("", ln.text)) is None
    )


# A row of that table ("[  2665]  0  2665  55756  339  77824  68  0 crond": pid, uid, tgid,
# page counts, oom_score_adj, name; 5 to 10 numbers by kernel version). Two rows or more
# are the OOM killer's report even when its header and verdict lines were cut.
_OOM_TASK_ROW = re.compile(r"^\[\s*\d+\]\s+\d+\s+\d+(?:\s+\d+){2,8}\s+-?\d+\s+\S+\s*$")
_KILLED = re.compile(
    r"^Killed(?:\s+.*)?$|\bKilled$"
    # bash reporting a child it lost: "./entrypoint.sh: line 28:  7 Killed   cmd ..."
    r"|\bline \d+:\s+\d+ Killed\b"
    r"|(?:exit ?code|exitcode|exit status|returncode)[=: ]+(?:-9|137)\b"
    r"|\bexit(?:ed)?(?: with)?(?: exit)? (?:code|status)[=: ]+(?:-9|137)\b"
    r"|(?:killed by |received |terminated by )signal (?:9|SIGKILL)\b",
    _I,
)
# A bare "SIGKILL" is host memory only when nobody was stopping the engine on purpose.
_SIGKILL = re.compile(r"\bSIGKILL\b", _I)
_REQUESTED_STOP = re.compile(
    r"\bSIG(?:TERM|INT)\b|signal (?:15|2)\b|\[shutdown\]|Shutting down|shutdown complete"
    r"|KeyboardInterrupt|\bStopping\b",
    _I,
)

# other_fatal: (pattern, subclass, restartable)
_OTHER: tuple[tuple[re.Pattern[str], str, bool], ...] = (
    (
        re.compile(
            r"Expandable segments are not compatible"
            r"|expandable_segments.*not (?:compatible|supported)",
            _I,
        ),
        "expandable_segments_incompatible",
        True,
    ),
    (
        re.compile(
            r"illegal memory access|illegal instruction|misaligned address"
            r"|device-side assert(?:ion)? triggered|unspecified launch failure",
            _I,
        ),
        "illegal_memory_access",
        True,
    ),
    (
        re.compile(
            r"uncorrectable ECC|ECC error|\bXid\b|GPU is lost|fallen off the bus"
            r"|GPU (?:has )?fallen|NVML_ERROR_GPU_IS_LOST",
            _I,
        ),
        "ecc_xid",
        True,
    ),
    (
        re.compile(
            r"driver version is insufficient|no kernel image is available"
            r"|NVIDIA driver on your system is too old|Driver/library version mismatch"
            r"|forward compatibility was attempted|unsupported PTX version"
            r"|unsupported display driver|CUDA driver version .*insufficient"
            r"|compiled with .*CUDA .* but .*driver",
            _I,
        ),
        "driver_mismatch",
        False,
    ),
    (
        re.compile(
            r"No CUDA GPUs are available|no CUDA-capable device|Found no NVIDIA driver"
            r"|Failed to infer device type|CUDA driver initialization failed"
            r"|Device string must not be empty"
            r"|No (?:GPU|accelerator|HIP GPUs?) (?:found|available)",
            _I,
        ),
        "no_device",
        False,
    ),
    (
        re.compile(
            r"Repository Not Found|is not a local folder and is not a valid model identifier"
            r"|does not appear to have (?:a )?files? named|Invalid repository ID"
            r"|Cannot access gated repo|GatedRepoError|RepositoryNotFoundError"
            r"|(?:401|403|404) Client Error.*(?:huggingface|hf\.co)"
            r"|No such file or directory: .*config\.json|Can't load the configuration of"
            # Weights the engine's user cannot open (vLLM reports an unreadable file as
            # missing: seen under the systemd unit with a 0600 root-owned safetensors):
            r"|(?:No such file or directory|Permission denied):? .*(?:\.(?:safetensors|gguf|pth?)"
            r"|pytorch_model\S*\.bin|(?:tokenizer(?:_config)?|(?:pre)?processor_config"
            r"|generation_config|config)\.json)\b"
            r"|model .* (?:does not exist|not found)"
            # A local path that does not exist is taken for a hub id and rejected:
            r"|Repo id must be in the form|HFValidationError"
            # HF_HUB_OFFLINE=1 (chandrad's default) and the weights are not in the cache:
            r"|LocalEntryNotFoundError|outgoing traffic has been disabled",
            _I,
        ),
        "model_not_found",
        False,
    ),
    (
        re.compile(
            r"Model architectures? .* (?:are|is) not supported"
            r"|does not recognize this architecture|Unrecognized model in"
            r"|Error in inspecting model architecture|is not supported for now"
            r"|model type .* but Transformers does not recognize",
            _I,
        ),
        "unsupported_architecture",
        False,
    ),
    # vLLM's start-up checks of the scheduler's and encoder's budgets against each other:
    # the same settings fail the same way, so no restart; the ladder must not produce them.
    (
        re.compile(r"max_num_batched_tokens \(\d+\) is smaller than max_model_len", _I),
        "batched_tokens_below_model_len",
        False,
    ),
    (
        re.compile(
            r"max_num_batched_tokens \(\d+\) must be greater than or equal to max_num_seqs", _I
        ),
        "batched_tokens_below_max_num_seqs",
        False,
    ),
    (
        re.compile(r"max_tokens_per_mm_item \(\d+\) is larger than max_num_batched_tokens", _I),
        "mm_item_exceeds_batched_tokens",
        False,
    ),
    (
        # Weights held by another process (RL weight sharing) above the utilisation budget.
        re.compile(r"Externally held weights on device .* exceed the desired GPU memory", _I),
        "external_weights_exceed_utilization",
        False,
    ),
    (
        re.compile(
            r"weights? (?:take|need|require)s? .* (?:exceed|larger than|more than) .*"
            r"(?:GPU|device|total)",
            _I,
        ),
        "weights_too_large",
        False,
    ),
    (
        re.compile(r"Address already in use|\[Errno 98\]|EADDRINUSE", _I),
        "address_in_use",
        True,
    ),
    (
        re.compile(
            r"NCCL error|\bnccl(?:Internal|System|UnhandledCuda|InvalidUsage|Remote)Error"
            r"|Watchdog caught collective operation timeout|NCCL communicator was aborted"
            r"|NCCL WARN|ProcessGroupNCCL.*(?:timeout|Timeout\(ms\).*ran for)",
            _I,
        ),
        "nccl",
        True,
    ),
    (
        re.compile(r"\bOutOfResources\b|out of resource: shared memory", _I),
        "kernel_resources",
        True,
    ),
    (
        re.compile(r"\b(?:CUDA|HIP|Cuda|cuda|hip)[ _]?(?:error|Error|ERROR)\b", 0),
        "cuda_error",
        True,
    ),
    (
        re.compile(
            r"Fatal Python error|\bSIGABRT\b|\bSIGSEGV\b|Segmentation fault|core dumped"
            r"|terminate called after throwing"
            # C++'s failed operator new: a corrupt or overflowed size as often as a full host.
            r"|\bstd::bad_alloc\b"
            # Rust's and Go's panics (launchers and routers in front of an engine).
            r"|\bthread '[^']*' panicked at\b|^panic: \S|^goroutine \d+ \[",
            _I,
        ),
        "crash",
        True,
    ),
    (
        re.compile(
            r"EngineCore encountered a fatal error|EngineCore failed to start"
            r"|Engine core initialization failed|Engine process failed to start"
            r"|WorkerProc failed to start|WorkerProc hit an exception"
            r"|MQLLMEngine is already dead|Engine loop has died|\bEngineDeadError\b"
            r"|Background loop has errored|Task finished unexpectedly"
            r"|got fatal signal from worker processes"
            # "Engine core proc EngineCore_DP0 died unexpectedly", "Worker proc VllmWorker-1
            # died unexpectedly", Ray's "The actor died unexpectedly" / ActorDiedError.
            r"|\b(?:engine|worker|core|actor)\w*\b[^\n]{0,50}?\bdied\b|\bActorDiedError\b",
            _I,
        ),
        "engine_died",
        True,
    ),
    (
        re.compile(
            r"(?:exited|died)\b[^\n]{0,30}?(?:exit )?(?:code|status)[=: ]+(?!0\b|-9\b|137\b)-?\d+"
            # "returned non-zero exit status 1", "Process finished with exit code 1".
            r"|non-zero exit status|\bexit code[=: ]+(?!0\b|-9\b|137\b)-?\d+",
            _I,
        ),
        "exited",
        True,
    ),
)

# other_fatal subclasses that a requested shutdown also produces.
_AFTER_STOP_BENIGN = frozenset({"engine_died", "exited", "crash"})

# A Python exception at the start of a cleaned line: "ValueError: ...", "torch.X: ...".
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Exit)\b:?")
# A failure stated without a Python exception line (see _diagnose, step 6). Not
# "Exception ignored in: <function __del__>", which interpreters print at a clean exit.
_FAILURE_STATEMENT = re.compile(
    r"^(?:Exception|Error)\s*:\s*\S"
    # "Scheduler hit an exception: …", "Method Warmup encountered an error.": whatever the level.
    r"|\b(?:hit|encountered|raised) an? (?:unexpected |unhandled |fatal )?(?:error|exception)\b"
    # An exception class named by its module rather than its suffix ("zmq.error.Again: …",
    # "httpx.ReadTimeout: …", "subprocess.TimeoutExpired: …").
    r"|^(?:[A-Za-z_]\w*\.)*(?:exceptions?|errors?|exc)\.[A-Z]\w*:\s*\S"
    r"|^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Timeout|Expired)\b:\s*\S"
    r"|^Exception (?:in|while|during|occurred|raised)\b(?! ignored)"
    r"|^Error (?:executing|while|during|in|occurred|when)\b"
    r"|^(?:[a-z_]\w*\.)+(?:[A-Z]\w*)?(?:Failed|Unsupported|BrokenProcessPool)\b:?"
    # vLLM's dump_engine_exception: logged only when a step of the engine raised.
    r"|^Dumping (?:input data|scheduler output for model execution|model input for execution)\b"
    r"|^Errored Batch request #\d",
)
# At ERROR level, a line that says something failed.
_FAILURE_WORD = re.compile(
    r"\b(?:fail(?:ed|s|ure)?|fatal|crash(?:ed)?|abort(?:ed|ing)?|exception|error|died"
    r"|unable to|cannot|could not)\b",
    _I,
)
_BENIGN_EXCEPTIONS = re.compile(r"^(?:asyncio\.)?CancelledError|^KeyboardInterrupt|^SystemExit")

# Words that make what follows on the line a possibility, not a report: a hint, a list of
# candidate causes ("There are some potential root causes."), a guess ("most likely").
_HEDGE = re.compile(
    r"\b(?:causes? (?:include|may be|could be)|could|might|may (?:be|have)|possibl[ey]"
    r"|probably|perhaps|e\.g\.|such as|if|whether|potential(?:ly)?|likely|suspect(?:ed)?"
    r"|maybe|causes|reasons|root cause)\b",
    _I,
)
# An item marker of an enumeration in running text: "(1) …", "2) …".
_ENUM_ITEM = re.compile(r"(?:\(|(?<![\w.(])) ?\d{1,2} ?\)(?=\s)")


def _hedged(text: str, start: int) -> bool:
    """Is what starts at ``text[start]`` a possibility rather than a report?

    Hedged when a hedge word precedes it on its line, or when it is one item of an
    enumeration of alternatives on that line (an item marker before it and at least two
    in all): a message listing what *might* have happened asserts none of them.
    """
    if _HEDGE.search(text[:start]):
        return True
    return bool(_ENUM_ITEM.search(text[:start])) and len(_ENUM_ITEM.findall(text)) >= 2
# A traceback's header (also inside a line: "Scheduler hit an exception: Traceback …", rich's
# boxed header), a frame in CPython's and faulthandler's form, multiprocessing's
# "Process EngineCore_0:" line before a child's traceback; IPython's and Colab's frames
# ("/x.py in f(…)", "[/x.py](url) in f(…)", "File ~/x.py:12, in f(…)", "Cell In[3], line 5",
# "----> 12 llm = LLM(…)") and rich's ("│ /x.py:12 in f"); a native backtrace (glibc's
# "bin(sym+0x1f) [0x55…]", gdb's "#3 0x7f… in f", c10's "frame #3: …", "Exception raised from").
_TRACEBACK = re.compile(
    r'Traceback \(most recent call last\)|^File "[^"]+", line \d+'
    r"|^Process [A-Za-z_][\w-]*:$"
    r"|^(?:File )?\[?[^\s\[\]]+\.py(?:\]\([^)\s]*\))?(?::\d+)?,? in [\w<>.]+(?:\(|\s*│?\s*$)"
    r"|^Cell In ?\[\d*\], line \d+|^<ipython-input-[\w-]+> in |^-{2,}> ?\d+ \S|^-*> ?\d+\s{2,}\S"
    r"|\(\S*\+0x[0-9a-fA-F]+\)\s*\[0x[0-9a-fA-F]+\]|^#\d+\s+0x[0-9a-fA-F]+ in \S"
    r"|^frame #\d+: |^Exception raised from \w+ at ",
)

_SHUTDOWN_SIGNAL = re.compile(
    r"received signal=?\s*SIG(?:TERM|INT)|(?:SIGTERM|SIGINT) received|Received (?:SIGTERM|SIGINT)"
    # systemd: the service's main process ended by the SIGTERM/SIGINT of a stop.
    r"|code=killed, status=(?:15/TERM|2/INT)\b"
    r"|signal (?:SIGTERM|SIGINT|15|2) received"
    # Python's SIGINT (Ctrl-C, or a wrapper interrupting the engine) as a bare exception line.
    r"|^KeyboardInterrupt\b",
    _I,
)

# Phase markers for a device OOM that no vLLM message places.
_STARTUP_FAILED = re.compile(
    r"EngineCore failed to start|Engine core initialization failed"
    r"|Engine process failed to start|Failed to load model"
    r"|Error (?:while|when) (?:loading|initializing)",
    _I,
)
# The engine reached serving: a log line printed only once it was ready.
_READY_MARKS = re.compile(
    r"init engine \(profile, create kv cache, warmup model\) took"
    r"|Application startup complete|Uvicorn running on|Started server process"
    r"|Starting vLLM API server|Available routes are|Avg prompt throughput|Running: \d+ reqs"
    r"|\"(?:POST|GET) /v1/\S* HTTP/[\d.]+\" \d{3}|Processed prompts|Adding requests"
    # A request reaching the server: access-log lines without the status, uvicorn's, SGLang's.
    r"|\b(?:POST|GET) /(?:v1/|generate\b|invocations\b|chat\b)"
    r"|Avg generation throughput|GPU KV cache usage: \d|Prefix cache hit rate"
    r"|Received request|Added request|Finished request|Aborted request"
    # SGLang's scheduler: "Decode batch. #running-req: 5, ... gen throughput (token/s)".
    r"|\b(?:Prefill|Decode) batch\b|#running-req|gen throughput|The server is fired up",
    _I,
)
# A failure reported against a request, session or job (an id names it): whatever the app,
# the model was loaded and serving work when it failed. Ids: UUIDs, OpenAI-style
# "chatcmpl-…"/"cmpl-…", long hex. Not Ray's task and job ids: Ray prints them while the
# engine's workers start.
_REQUEST_CONTEXT = re.compile(
    r"\b(?:chat)?cmpl-[0-9A-Za-z]{6,}"
    r"|\b(?:request|req|session|invocation)(?:[ _-]?id)?\b[\s:=#'\"]*"
    r"(?:[0-9a-f]{8}-[0-9a-f]{4}-|[0-9a-f]{16,}\b)",
    _I,
)
# Frames and messages of start-up: loading weights, profiling, sizing and allocating the KV
# cache, warming up, capturing CUDA graphs (V1 and V0 names; SGLang's where vLLM wraps it).
_LOAD_FRAMES = re.compile(
    r"\b(?:load_model|load_weights|_load_weights|profile_run|_dummy_run|_dummy_sampler_run"
    r"|_dummy_pooler_run|determine_available_memory|determine_num_available_blocks"
    r"|capture_model|_capture_cudagraphs|compile_or_warm_up_model|initialize_kv_cache"
    r"|_initialize_kv_caches|init_device|initialize_from_config|init_worker"
    r"|_init_executor|load_model_weights|profile_cudagraph_memory|make_layers"
    r"|initialize_model|_initialize_model|get_model|warming_up_model"
    r"|weight_loader|create_weights|process_weights_after_loading|_allocate_kv_cache"
    r"|CacheEngine|init_cache_engine|initialize_cache|_init_cache|from_engine_args"
    r"|from_vllm_config|run_mp_engine|init_memory_pool|_init_kv_cache"
    # SGLang's start-up (model_runner.initialize, CUDA graphs) and Hugging Face loading.
    r"|init_cuda_graphs|CudaGraphRunner|init_torch_distributed|from_pretrained"
    r"|load_state_dict|load_checkpoint|_load_pretrained_model)\b"
    r"|\w*dummy\w*|warm(?:ing)?[_ ]?up"
    r"|Loading model weights|Loading safetensors|Memory profiling|Capturing CUDA graph"
    r"|Starting profile run|Starting to load model|Loading weights took|Model loading took"
    r"|Loading checkpoint shards|Load weight (?:begin|end)|Initializing an? (?:V1 )?LLM engine"
    r"|Capture cuda graph|Memory pool end|Compiling a graph|Dynamo bytecode transform",
    _I,
)
# Frames and messages of serving: the engine loop, request handling, sleep-mode wake-up.
_SERVING_FRAMES = re.compile(
    r"\b(?:execute_model_async|engine_step|run_engine_loop|step_fn|run_busy_loop"
    r"|_process_engine_step|step_with_batch_queue|start_worker_execution_loop|wake_up"
    r"|resume|output_handler|_run_engine|step_async|sample_tokens|_log_task_completion"
    r"|_raise_exception_on_finish|forward_thread_func|event_loop_(?:normal|overlap)"
    r"|forward_batch_generation|err_execute_model_input|AsyncEngineDeadError"
    r"|MQEngineDeadError|EngineDeadError"
    # Generation requested by a caller: vLLM's offline LLM, OpenAI handlers, Hugging Face's
    # generate loop, RL trainers' rollouts.
    r"|_generate|generate_sequences|create_chat_completion|create_completion"
    r"|chat_completion_stream_generator|completion_stream_generator|greedy_search"
    r"|beam_search|_validate_and_add_requests|process_input_sockets)\b"
    r"|, in (?:generate|chat|_run_engine)$"
    r"|serving_\w+\.py|starlette/|fastapi/|async_llm_engine\.py:\d+\]"
    r"|Engine loop is not running|Engine loop has died|Engine background task failed"
    r"|Background loop has errored|Error in model execution|Dumping scheduler output"
    r"|Internal Server Error|inference error"
    # The failure stated against a request or a generation, in any stack's words ("Request
    # failed during generation"), or the text saying requests were being handled.
    r"|\brequest(?:s| \S+)? failed\b"
    r"|\b(?:during|while) (?:generation|generating|decoding|inference|serving)\b"
    r"|\b(?:handl|process|serv)(?:e|es|ed|ing) (?:(?:a|the|some|a few|many|several|\d+) )?"
    r"requests?\b|\bafter (?:a few|some|several|many|\d+) (?:\w+ )?requests?\b",
    _I,
)
# Weak, used only when nothing above is in the text: the model forward runs in the profile
# run too but mostly while serving; a KV cache already sized means profiling is over (the
# start-up steps left, warm-up and graph capture, print markers of their own).
_WEAK_SERVING = re.compile(
    r"\bexecute_model\b|# (?:GPU|CUDA) blocks: [1-9]|GPU KV cache size: [1-9]"
    # The sampler (V0 layers/sampler.py, V1 v1/sample/sampler.py): its start-up warm-up shows
    # its own frame (_dummy_sampler_run, profile_run), so sampler frames alone mean a batch.
    r"|\bsampler\.py\b|\bget_logprobs\b"
    # Steps of V1's GPUModelRunner.execute_model that the start-up dummy runs do not take
    # (request state, the multimodal encoder of scheduled requests, prompt logprobs,
    # speculative decoding) and V0's output processing of an engine step.
    r"|\b(?:_update_states|_execute_mm_encoder|_gather_mm_embeddings|_bookkeeping_sync"
    r"|_get_prompt_logprobs_dict|_calc_spec_decode_metadata|propose_draft_token_ids"
    r"|_process_model_outputs)\b"
    # vLLM's sleep-mode allocator: it maps memory when a sleeping engine is woken up.
    r"|\bcumem_allocator\b"
    # Code the reporter pasted with the error (their script, not a frame of the failure):
    # a generate call or a loop over inputs ("for batch in batches:"). Weak, because the
    # same script also constructs the engine, which may be what failed.
    r"|\.generate\(|\bfor \w+ in [\w.]*(?:batch|loader|prompt|request|sample|input)\w*",
    _I,
)
# Weaker still: a model's forward or a forward kernel ("in forward", "in _call_impl", "in
# attn_fwd") in a paste from a stack other than vLLM, where a forward with no loading frame
# is inference (or training) work. Not in a vLLM paste: vLLM's start-up profile run executes
# the same forward, and vLLM's serving loop has markers of its own.
_MODEL_FORWARD = re.compile(r", in (?:\w*forward\w*|\w*_fwd|fwd_\w*|_(?:wrapped_)?call_impl)$")
_VLLM_TEXT = re.compile(r"vllm", _I)

_ACTIONS: dict[FailureClass, str] = {
    FailureClass.CUDA_OOM_LOAD: (
        "restart with enforce_eager, then lower max_num_seqs/max_num_batched_tokens, "
        "then cpu_offload_gb"
    ),
    FailureClass.KV_CACHE_INSUFFICIENT: (
        "restart with max_model_len fitted to the estimated maximum if it still covers a page, "
        "otherwise give the KV cache more memory"
    ),
    FailureClass.FRAGMENTATION: (
        "restart with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; "
        "if it recurs, treat as a runtime OOM"
    ),
    FailureClass.GPU_MEMORY_UTILIZATION_TOO_HIGH: (
        "restart with gpu_memory_utilization lowered to the free memory minus a margin, "
        "or free the GPU memory other processes hold"
    ),
    FailureClass.CUDA_OOM_RUNTIME: (
        "restart with max_num_seqs and max_num_batched_tokens halved and a lower pixel budget"
    ),
    FailureClass.HOST_OOM: (
        "host RAM ran out: restart with a smaller mm_processor_cache_gb and fewer concurrent "
        "renders, or give the machine more memory"
    ),
    FailureClass.MAMBA_CACHE_INSUFFICIENT: (
        "restart with max_num_seqs lowered to the Mamba cache blocks vLLM names"
    ),
    FailureClass.ENGINE_HUNG: (
        "restart the engine; its requests go back to the queue uncharged"
    ),
    FailureClass.ENGINE_EXITED: (
        "restart with backoff, same profile; an engine that keeps exiting ends fatal"
    ),
    FailureClass.OTHER_FATAL: "restart with backoff without changing memory settings",
    FailureClass.NONE: "nothing to do",
}
_FATAL_ACTIONS: dict[str, str] = {
    "model_not_found": (
        "fix engine.model (id or path), the Hugging Face access token, or the model "
        "files' permissions for the daemon's user, then reload; with engine.offline = true "
        "the cache must hold the model: run `chandrad fetch-model --config <config>` as the "
        "daemon's user (or copy a cache fetched elsewhere)"
    ),
    "unsupported_architecture": (
        "the installed vLLM cannot run this model: install a vLLM that supports it"
    ),
    "no_device": "no usable GPU is visible: check the driver, device permissions and engine.gpus",
    "driver_mismatch": "the NVIDIA driver does not match the CUDA/PyTorch build: fix the install",
    "weights_too_large": (
        "the weights do not fit this GPU: use more GPUs, a quantized model or cpu_offload_gb"
    ),
    "expandable_segments_incompatible": (
        "restart without PYTORCH_CUDA_ALLOC_CONF=expandable_segments (vLLM's memory pool "
        "cannot use it)"
    ),
    "address_in_use": "another process holds the engine port: free it or change engine.port",
    "batched_tokens_below_model_len": (
        "max_num_batched_tokens is below max_model_len: raise max_num_batched_tokens to at "
        "least max_model_len, lower max_model_len, or enable chunked prefill"
    ),
    "batched_tokens_below_max_num_seqs": (
        "max_num_batched_tokens is below max_num_seqs: raise it or lower max_num_seqs"
    ),
    "mm_item_exceeds_batched_tokens": (
        "one image's tokens exceed max_num_batched_tokens with chunked multimodal input off: "
        "raise max_num_batched_tokens or lower the pixel budget"
    ),
    "external_weights_exceed_utilization": (
        "weights held outside the engine exceed its gpu_memory_utilization share: raise it"
    ),
    "ecc_xid": "the GPU reported a hardware fault: check dmesg/nvidia-smi; restart with backoff",
}


@dataclass(frozen=True)
class _Hit:
    index: int
    cls: FailureClass
    subclass: str = ""
    restartable: bool = True


_CODE_LINE = re.compile(r"^(?:raise|File \"|return|assert|if|elif|except|[\w.]+ = |\^+$)")


def _rank(line: _Line) -> int:
    """Prefer the exception line itself over source code quoted in a traceback."""
    if _EXCEPTION.match(line.text):
        return 0
    return 2 if _CODE_LINE.match(line.text) else 1


def _find(
    lines: Sequence[_Line],
    pattern: re.Pattern[str],
    *,
    any_level: bool = False,
    unless_hedged: bool = False,
    reject: Callable[[_Line], bool] | None = None,
) -> int:
    """Index of the best line matching ``pattern`` (an exception line first), or -1.

    With ``unless_hedged``, a match that its line only states as a possibility does not count
    ("Some common causes include: (1) the process was killed by the OOM killer"); nor does a
    line that ``reject`` refuses.
    """
    best, best_rank = -1, 3
    for i, ln in enumerate(lines):
        m = pattern.search(ln.text) if (any_level or not ln.benign_level) else None
        if m and unless_hedged and _hedged(ln.text, m.start()):
            m = None
        if m and reject is not None and reject(ln):
            m = None
        if m:
            r = _rank(ln)
            if r < best_rank:
                best, best_rank = i, r
                if r == 0:
                    break
    return best


def _window(lines: Sequence[_Line], i: int, extra: int = 3) -> str:
    return " ".join(ln.text for ln in lines[i : i + 1 + extra])


def _message(lines: Sequence[_Line], i: int, extra: int = 5, *, glued: bool = False) -> str:
    """The message that starts on line ``i`` with the lines a paste's hard wrap split off.

    PyTorch's allocator message is one line of ~400 characters; pasted into an issue or a
    terminal it is often wrapped over three or four, and its figures ("… is reserved by
    PyTorch but unallocated") end up on the last. Continuation lines are taken until a line
    that starts something else: a traceback frame, another exception, another OOM, a blank.
    """
    parts = [lines[i].text]
    for ln in lines[i + 1 : i + 1 + extra]:
        if (
            not ln.text
            or _TRACEBACK.match(ln.text)
            or _EXCEPTION.match(ln.text)
            or _DEVICE_OOM.search(ln.text)
        ):
            break
        parts.append(ln.text)
    out = parts[0]
    for part in parts[1:]:
        # A terminal's hard wrap falls at a fixed column, inside a word or a figure
        # ("16." / "00 GiB", "unalloc" / "ated"): a figure is always glued back together,
        # a word when ``glued`` asks for it.
        number_split = re.search(r"\d\.?$", out) and re.match(r"\.?\d", part)
        out += part if glued or number_split else " " + part
    return out


def _oom_figures(lines: Sequence[_Line], i: int) -> dict[str, float]:
    """The allocator's figures of the message at line ``i``, read with the hard wraps taken
    as spaces and, for the figures that reading misses, as splits inside a word."""
    n = _oom_numbers(_message(lines, i))
    for key, value in _oom_numbers(_message(lines, i, glued=True)).items():
        _put(n, key, value)
    return n


def _wrapped_match(
    lines: Sequence[_Line], i: int, pattern: re.Pattern[str], sep: str = " "
) -> bool:
    """Does ``pattern`` match across the hard wrap between line ``i`` and the next
    ("RuntimeError: CUDA out of" / "memory. Tried to allocate …")? ``sep`` is what the wrap
    replaced: a space, or nothing where a fixed-column wrap cut a word ("not enough mem" /
    "ory")."""
    if i + 1 >= len(lines) or not lines[i].text or not lines[i + 1].text:
        return False
    head = lines[i].text
    m = pattern.search(head + sep + lines[i + 1].text)
    return m is not None and m.start() < len(head) < m.end()


def _find_host_oom(lines: Sequence[_Line]) -> int:
    """The line asserting that the host's RAM ran out (kernel, systemd-oomd, Ray's memory
    monitor, an allocator's ENOMEM), or -1; also found across a paste's hard wrap, at a space
    or inside a word, between two lines not at a benign level."""
    for pattern in (_RAY_HOST_OOM, _HOST_OOM):
        i = _find(lines, pattern, any_level=True, unless_hedged=True, reject=_not_host_oom_line)
        if i >= 0:
            return i
    for k, ln in enumerate(lines[:-1]):
        nxt = lines[k + 1]
        if ln.benign_level or nxt.benign_level:
            continue
        for sep in (" ", ""):
            joined = ln.text + sep + nxt.text
            m = _HOST_OOM.search(joined)
            if (
                _wrapped_match(lines, k, _HOST_OOM, sep)
                and m is not None
                and not _hedged(joined, m.start())
                and not _not_host_ram(joined)
            ):
                return k
    return -1


def _find_message(lines: Sequence[_Line], pattern: re.Pattern[str]) -> int:
    """:func:`_find` for one of vLLM's own memory messages, which are long sentences: when no
    line holds the wording whole, the first line (not at a benign level) where a paste's hard
    wrap split it across itself and the next."""
    i = _find(lines, pattern)
    if i >= 0:
        return i
    return next(
        (
            k
            for k, ln in enumerate(lines)
            if not ln.benign_level
            and not (k + 1 < len(lines) and lines[k + 1].benign_level)
            and _wrapped_match(lines, k, pattern)
        ),
        -1,
    )


def _device_oom_hits(lines: Sequence[_Line]) -> list[int]:
    out = []
    for i, ln in enumerate(lines):
        if ln.benign_level or _RAY_HOST_OOM.search(ln.text):
            continue
        m = _DEVICE_OOM.search(ln.text)
        if m is not None and _hedged(ln.text, m.start()):
            continue
        if m is not None or _wrapped_match(lines, i, _DEVICE_OOM):
            out.append(i)
    if not out:
        last = next((k for k in range(len(lines) - 1, -1, -1) if lines[k].text), -1)
        if (
            last >= 0
            and not lines[last].benign_level
            and _DEVICE_OOM_CUT.search(lines[last].text)
            and not _RAY_HOST_OOM.search(lines[last].text)
        ):
            out.append(last)
    return out


def _phase_is_runtime(lines: Sequence[_Line], oom_index: int, was_ready: bool) -> bool:
    """Was the engine serving when the device ran out of memory?

    Without the readiness history (a pasted excerpt) the frames and messages around the
    error decide: start-up work (weights, profile run, KV cache sizing, warm-up) against
    the serving loop. With both in the text, the marker nearest the error wins.
    """
    if was_ready:
        return True
    if any(_STARTUP_FAILED.search(ln.raw) for ln in lines):
        return False
    load: list[int] = []
    serving: list[int] = []
    for k, ln in enumerate(lines):
        if (
            _READY_MARKS.search(ln.raw)
            or _SERVING_FRAMES.search(ln.raw)
            or _REQUEST_CONTEXT.search(ln.raw)
        ):
            serving.append(k)
        elif _LOAD_FRAMES.search(ln.raw):
            load.append(k)
    if load and serving:
        return min(abs(k - oom_index) for k in serving) < min(abs(k - oom_index) for k in load)
    if load or serving:
        return bool(serving)
    if any(_WEAK_SERVING.search(ln.raw) for ln in lines):
        return True
    return not any(_VLLM_TEXT.search(ln.raw) for ln in lines) and any(
        _MODEL_FORWARD.search(ln.text) for ln in lines
    )


def _kv_numbers(text: str) -> dict[str, float]:
    n: dict[str, float] = {}
    _put(n, "max_model_len", _int_after(r"max seq len", text))
    _put(n, "needed_gib", _size_before(r"KV\s*cach", text))
    _put(n, "available_gib", _size_after(r"available KV cache memory\s*\(", text))
    _put(n, "estimated_max_model_len", _int_after(r"estimated maximum model length is", text))
    _put(n, "kv_cache_tokens", _int_after(r"can be stored in KV cache", text))
    return n


def _gmu_numbers(text: str) -> dict[str, float]:
    n: dict[str, float] = {}
    m = re.search(
        r"Free memory on device.*?\(\s*([\d.]+)\s*/\s*([\d.]+)\s*(GiB|GB|MiB|MB)\s*\)", text, _I
    )
    if m:
        n["free_gib"] = _gib(m.group(1), m.group(3))
        n["total_gib"] = _gib(m.group(2), m.group(3))
    # CPU backend: "Available memory on node 0 (12.4/62.7 GiB) on kv cache allocation is less
    # than requested memory for kv (18.1/31.35 GiB)" (or "(40.0 GiB)").
    m = re.search(
        r"Available memory on node.*?\(\s*([\d.]+)\s*/\s*([\d.]+)\s*(GiB|GB|MiB|MB)\s*\)", text, _I
    )
    if m:
        n["free_gib"] = _gib(m.group(1), m.group(3))
        n["total_gib"] = _gib(m.group(2), m.group(3))
    m = re.search(
        r"requested memory for kv\s*\(\s*([\d.]+)\s*(?:/\s*[\d.]+\s*)?(GiB|GB|MiB|MB)", text, _I
    )
    if m:
        n["requested_gib"] = _gib(m.group(1), m.group(2))
    m = re.search(
        r"(?:utilization|excluding external process's weights)\s*\(\s*([\d.]+)\s*,\s*" + _SIZE,
        text,
        _I,
    )
    if m:
        n["gpu_memory_utilization"] = float(m.group(1))
        n["requested_gib"] = _gib(m.group(2), m.group(3))
    _put(n, "initial_free_gib", _size_after(r"Initial free memory", text))
    _put(n, "current_free_gib", _size_after(r"current free memory", text))
    return n


def _budget_numbers(text: str) -> dict[str, float]:
    """The settings a scheduler/encoder budget check names ("max_num_batched_tokens (8192) is
    smaller than max_model_len (18000)"), by their own names."""
    n: dict[str, float] = {}
    keys = ("max_num_batched_tokens", "max_model_len", "max_num_seqs", "max_tokens_per_mm_item")
    for key in keys:
        m = re.search(r"\b" + key + r"\s*\(\s*(\d[\d,]*)\s*\)", text)
        if m:
            n[key] = float(m.group(1).replace(",", ""))
    return n


def _mamba_numbers(text: str) -> dict[str, float]:
    n: dict[str, float] = {}
    _put(n, "max_num_seqs", _int_after(r"max_num_seqs", text))
    _put(n, "mamba_cache_blocks", _int_after(r"Mamba cache\s+blocks", text))
    _put(n, "mamba_cache_blocks", _int_after(r"lower max_num_seqs to at most", text))
    return n


def _diagnose(lines: Sequence[_Line], exit_code: int | None, was_ready: bool) -> Diagnosis:
    # 1. vLLM's own memory messages name their class. The Mamba-state check runs after the
    # KV cache was sized, so its message is the cause whatever KV lines precede it.
    i = _find_message(lines, _MAMBA)
    if i < 0:
        i = _find_message(lines, _MAMBA_TAIL)
    if i < 0:
        i = _find(lines, _MAMBA_ASSERT)
    if i >= 0:
        return _make(
            FailureClass.MAMBA_CACHE_INSUFFICIENT, lines[i], _mamba_numbers(_window(lines, i))
        )
    i = _find_message(lines, _KV_NO_MEMORY)
    if i < 0:
        i = _find_message(lines, _KV_MAX_SEQ)
    if i < 0:
        i = _find(lines, _KV_FRAMES, any_level=True)
    if i < 0 and not _device_oom_hits(lines):
        i = _find(lines, _KV_INFO, any_level=True)
    if i >= 0:
        text = _window(lines, i)
        return _make(FailureClass.KV_CACHE_INSUFFICIENT, lines[i], _kv_numbers(text))

    i = _find_message(lines, _GMU)
    if i >= 0:
        return _make(
            FailureClass.GPU_MEMORY_UTILIZATION_TOO_HIGH, lines[i], _gmu_numbers(_window(lines, i))
        )

    # 2. Device OOM: fragmentation, runtime or load.
    ooms = _device_oom_hits(lines)
    vllm_load = _find_message(lines, _LOAD_OOM_VLLM)
    if ooms or vllm_load >= 0:
        per_msg = [_oom_figures(lines, j) for j in ooms]
        for j, n in zip(ooms, per_msg, strict=True):
            if _is_fragmentation(n):
                return _make(FailureClass.FRAGMENTATION, lines[j], n)
        # Prefer the OOM line that carries the allocator's figures as evidence.
        best = next((j for j, n in zip(ooms, per_msg, strict=True) if n), None)
        numbers = _oom_figures(lines, best) if best is not None else {}
        nccl = any(
            _NCCL_CONTEXT.search(ln.text) for j in ooms for ln in lines[max(j - 3, 0) : j + 1]
        )
        sub = "nccl_oom" if nccl else ""
        if vllm_load >= 0 and not was_ready:
            if not numbers:
                numbers = _oom_figures(lines, vllm_load)
            ev = lines[vllm_load]
            sub = "weights_load" if "load model" in ev.text.lower() else "warmup"
            return _make(FailureClass.CUDA_OOM_LOAD, ev, numbers, subclass=sub)
        first = best if best is not None else ooms[0]
        runtime = _phase_is_runtime(lines, first, was_ready)
        if not runtime and _request_exceeds_gpu(numbers):
            runtime = True
            sub = sub or "request_exceeds_gpu"
        cls = FailureClass.CUDA_OOM_RUNTIME if runtime else FailureClass.CUDA_OOM_LOAD
        return _make(cls, lines[first], numbers, subclass=sub)

    # 3. Host memory (asserted, not listed among possible causes).
    i = _find_host_oom(lines)
    if i >= 0:
        return _make(FailureClass.HOST_OOM, lines[i], {})
    rows = [ln for ln in lines if _OOM_TASK_ROW.match(ln.text)]
    if len(rows) >= 2:
        return _make(FailureClass.HOST_OOM, rows[0], {}, subclass="oom_killer_tasks")
    rows = [ln for ln in lines if _RAY_TOP_ROW.match(ln.text)]
    if len(rows) >= 2:
        return _make(FailureClass.HOST_OOM, rows[0], {}, subclass="ray_memory_monitor")

    # 4. Other fatal errors with a known cause. An engine dying or exiting after a
    #    requested shutdown (SIGTERM/SIGINT) is the shutdown's consequence, not a failure.
    stop = _find(lines, _SHUTDOWN_SIGNAL, any_level=True)
    before_stop = lines[:stop] if stop >= 0 else lines
    for pattern, sub, restartable in _OTHER:
        i = _find(before_stop if sub in _AFTER_STOP_BENIGN else lines, pattern)
        if i >= 0:
            return _make(
                FailureClass.OTHER_FATAL,
                lines[i],
                _budget_numbers(lines[i].text),
                subclass=sub,
                restartable=restartable,
            )

    # 5. Killed with nothing else to say: the kernel's OOM killer is the usual sender.
    i = _find(lines, _KILLED, any_level=True, unless_hedged=True)
    if i < 0 and not any(_REQUESTED_STOP.search(ln.text) for ln in lines):
        i = _find(lines, _SIGKILL, any_level=True, unless_hedged=True)
    if i >= 0 or exit_code in (-9, 137):
        killed = lines[i] if i >= 0 else None
        return _make(FailureClass.HOST_OOM, killed, {}, subclass="sigkill",
                     otherwise="killed by SIGKILL")

    # 6. Any other final exception, or a non-zero exit. Exceptions after a requested
    #    shutdown (SIGTERM/SIGINT) are its consequences (EngineDeadError), not a failure;
    #    so are those Python reports as unraisable ("Exception ignored in: …").
    ignored = _unraisable_report_lines(lines) | _request_rejection_lines(lines)
    last_exc = -1
    for k, ln in enumerate(lines[: stop if stop >= 0 else None]):
        if (
            k not in ignored
            and not ln.benign_level
            and _EXCEPTION.match(ln.text)
            and not _BENIGN_EXCEPTIONS.match(ln.text)
        ):
            last_exc = k
    if last_exc >= 0:
        return _make(FailureClass.OTHER_FATAL, lines[last_exc], {}, subclass="exception")
    # A traceback whose exception line the paste (or the log's tail) lost still proves that
    # something raised: a failure of unknown cause, never a memory verdict.
    frame = _find(
        [ln if k not in ignored else _Line(ln.raw, "", ln.level) for k, ln in enumerate(lines)][
            : stop if stop >= 0 else None
        ],
        _TRACEBACK,
    )
    if frame >= 0:
        return _make(FailureClass.OTHER_FATAL, lines[frame], {}, subclass="traceback")
    # A failure stated without an exception class or a traceback: "Exception in thread …",
    # a bare "Error: …", V0's "Error executing method …", an exception class that does not
    # end in Error, or a line logged at ERROR that says something failed.
    unignored = [
        ln if k not in ignored else _Line(ln.raw, "", ln.level) for k, ln in enumerate(lines)
    ][: stop if stop >= 0 else None]
    failed = _find(unignored, _FAILURE_STATEMENT, unless_hedged=True)
    if failed < 0:
        failed = next(
            (
                k
                for k, ln in enumerate(unignored)
                if ln.level == "ERROR" and _FAILURE_WORD.search(ln.text)
            ),
            -1,
        )
    if failed >= 0:
        return _make(FailureClass.OTHER_FATAL, lines[failed], {}, subclass="error")
    if exit_code not in (None, 0):
        last_err = next((ln for ln in reversed(lines) if ln.level == "ERROR" and ln.text), None)
        return _make(FailureClass.OTHER_FATAL, last_err, {}, subclass="exited",
                     otherwise=f"exited with status {exit_code}")
    return Diagnosis(cls=FailureClass.NONE, action=_ACTIONS[FailureClass.NONE])


_UNRAISABLE = re.compile(r"^Exception ignored (?:in|on|while)\b")
# A request vLLM refused while validating it (an image with more embeddings than the encoder
# cache holds, any VLLMValidationError): the API server logs the traceback and answers 400;
# the engine serves on. Also the handler's own line that introduces the traceback.
_REQUEST_REJECTED = re.compile(
    r"\bVLLMValidationError\b|exceeds the pre-allocated encoder cache size", _I
)
_REQUEST_HANDLER_LOG = re.compile(
    r"^Error (?:in preprocessing prompt inputs|preparing request components)\b", _I
)


def _request_rejection_lines(lines: Sequence[_Line]) -> set[int]:
    """Lines of the API server's report of a request it rejected as invalid: the exception,
    its traceback (back to "Traceback (most recent call last):") and the handler's line."""
    out: set[int] = set()
    for k, ln in enumerate(lines):
        if not (_EXCEPTION.match(ln.text) and _REQUEST_REJECTED.search(ln.text)):
            continue
        start = next(
            (j for j in range(k - 1, max(k - 60, -1), -1) if _TRACEBACK.match(lines[j].text)
             and lines[j].text.startswith("Traceback")),
            k,
        )
        if start > 0 and _REQUEST_HANDLER_LOG.match(lines[start - 1].text):
            start -= 1
        out.update(range(start, k + 1))
    return out


def _unraisable_report_lines(lines: Sequence[_Line]) -> set[int]:
    """Lines of Python's reports of unraisable exceptions: "Exception ignored in: <function
    X.__del__>" (or "… in atexit callback", "… while finalizing …"), the traceback after it
    and its exception line. The interpreter prints them for a destructor or an exit hook
    that raised, typically while it shuts down; nothing failed that the caller saw."""
    out: set[int] = set()
    k = 0
    while k < len(lines):
        if not _UNRAISABLE.match(lines[k].text):
            k += 1
            continue
        out.add(k)
        k += 1
        while k < len(lines) and not _UNRAISABLE.match(lines[k].text):
            out.add(k)
            k += 1
            if _EXCEPTION.match(lines[k - 1].text):
                break
    return out


def _request_exceeds_gpu(n: dict[str, float]) -> bool:
    """One allocation larger than the whole GPU, made once something was loaded.

    Weights load tensor by tensor; an allocation bigger than the GPU on top of
    allocated memory is sized by the input (a request, or the profile run's
    maximal batch), and the runtime remedy (smaller batches) is the one that helps.
    """
    r, total = n.get("requested_gib"), n.get("total_gib")
    loaded = n.get("allocated_gib", 0.0) > 0
    return r is not None and total is not None and r > total and loaded


def _make(
    cls: FailureClass,
    line: _Line | None,
    numbers: dict[str, float],
    *,
    subclass: str = "",
    restartable: bool = True,
    otherwise: str = "",
) -> Diagnosis:
    """The verdict proved by ``line``; with no line (an exit status alone), ``otherwise``
    is the evidence."""
    action = (
        _FATAL_ACTIONS.get(subclass, _ACTIONS[cls])
        if cls is FailureClass.OTHER_FATAL
        else (_ACTIONS[cls])
    )
    return Diagnosis(
        cls=cls,
        evidence=line.raw if line is not None else otherwise,
        numbers=numbers,
        action=action,
        restartable=restartable,
        subclass=subclass,
    )


# A log record pasted as JSON or as an HTTP error body keeps its newlines escaped.
_ESCAPED_NEWLINE = re.compile(r"(?:\\r)?\\n")
# ... where an escaped newline starts a line of a log (indentation, a frame, an exception),
# not a Windows path ("C:\\new\\nodes").
_ESCAPED_LINE_START = re.compile(
    r"\\n(?=\s|$|\\|Traceback|File |(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)\b)"
)


def _lines_of(chunk: str) -> list[str]:
    out: list[str] = []
    for line in chunk.splitlines() or [""]:
        # Two or more escaped newlines on one line: a traceback or a multi-line message
        # inside a JSON string ("Traceback (most recent call last):\\n  File …\\n…").
        if len(_ESCAPED_LINE_START.findall(line)) >= 2:
            out.extend(_ESCAPED_NEWLINE.split(line))
        else:
            out.append(line)
    return out


def _split(lines: Sequence[str] | str) -> list[str]:
    if isinstance(lines, str):
        return _lines_of(lines)
    out: list[str] = []
    for chunk in lines:
        out.extend(_lines_of(chunk))
    return out


def classify(
    lines: Sequence[str] | str, *, exit_code: int | None = None, was_ready: bool = False
) -> Diagnosis:
    """Classify engine output (a list of lines or one text) plus the exit status."""
    cleaned = [_clean(s) for s in _split(lines)]
    return _diagnose(cleaned, exit_code, was_ready)


# --------------------------------------------------------------------------- incremental

# Cheap test on the raw line: could it carry failure evidence at all?
_TRIGGER = re.compile(
    "|".join(
        p.pattern
        for p in (
            _MAMBA,
            _MAMBA_TAIL,
            _MAMBA_ASSERT,
            _KV_NO_MEMORY,
            _KV_MAX_SEQ,
            _KV_FRAMES,
            _GMU,
            _LOAD_OOM_VLLM,
            _DEVICE_OOM,
            _RAY_HOST_OOM,
            _HOST_OOM,
            *(o[0] for o in _OTHER),
        )
    ),
    _I,
)


class LineScanner:
    """Incremental classifier for a running engine: feed lines, get a verdict early."""

    def __init__(self, max_lines: int = 400) -> None:
        self._tail: deque[_Line] = deque(maxlen=max_lines)
        self._ready = False
        self._last: tuple[FailureClass, str, str] | None = None

    def mark_ready(self) -> None:
        """The engine reached ``ready``: later OOMs are runtime OOMs."""
        self._ready = True

    def feed(self, line: str) -> Diagnosis | None:
        """Add one line; return a Diagnosis when this line proves a (new) failure class."""
        new = [_clean(s) for s in (line.splitlines() or [""])]
        self._tail.extend(new)
        if not any(not ln.benign_level and _TRIGGER.search(ln.text) for ln in new):
            return None
        d = _diagnose(list(self._tail), None, self._ready)
        if d.cls is FailureClass.NONE:
            return None
        key = (d.cls, d.subclass, d.evidence)
        if self._last is not None and self._last[:2] == key[:2]:
            return None
        self._last = key
        return d

    def finish(self, exit_code: int | None, was_ready: bool) -> Diagnosis:
        """The verdict once the engine has exited."""
        return _diagnose(list(self._tail), exit_code, was_ready or self._ready)

    def lines(self) -> Iterable[str]:
        """The bounded tail, as quoted evidence lines."""
        return (ln.raw for ln in self._tail)


def action_for(cls: FailureClass) -> str:
    """What chandrad does about a failure of class ``cls`` (the ``action`` of its verdict)."""
    return _ACTIONS[cls]
