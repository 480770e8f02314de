"""Which of this book's techniques the serving engines ship: the landscape's data, with sources.

- ``FRAMEWORKS``: vLLM, SGLang, Hugging Face TGI, TensorRT-LLM, llama.cpp and Ollama, each with
  what it is, its status (TGI is in maintenance mode; Ollama runs on llama.cpp) and when to pick it;
  ``ALSO_PICKED``: MLX LM and LMDeploy, described the same way but not charted feature by feature;
- ``FEATURES``: the techniques, each naming the chapter that teaches it;
- ``SUPPORT[(feature_key, framework_name)]``: a short ``Cell`` per pair, with the bibliography keys
  (``book/references.bib``) of the documentation pages that state it. Where the pages read say
  nothing, the cell says "not documented": absence from the docs is not proof of absence.

The facts were read from the projects' own documentation (accessed 2026-12); engines move fast, so
each cell is a dated claim with its source, not a specification. ``book.landscape`` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

NOT_DOCUMENTED = "not documented"


@dataclass(frozen=True)
class Framework:
    """One engine: what it is, its status, when to pick it, and the pages that say so."""

    name: str
    kind: str
    summary: str
    pick_when: str
    cites: tuple[str, ...]


@dataclass(frozen=True)
class Feature:
    """A technique the book teaches, the chapter that teaches it, and a short label for text tables."""

    key: str
    name: str
    chapter: int
    short: str
    note: str = ""


@dataclass(frozen=True)
class Cell:
    """What one framework documents about one feature: ``value`` ("yes", "no", "partial: ...", a
    short list, or "not documented"), ``cites`` (bibliography keys), and ``short``, the value
    abbreviated for the plain-text table (defaults to ``value``)."""

    value: str
    cites: tuple[str, ...] = ()
    short: str = ""

    def __post_init__(self) -> None:
        if not self.value:
            raise ValueError("a cell needs a value")
        if not self.cites and not self.undocumented:
            raise ValueError(f"cell {self.value!r} states a fact but cites no source")

    @property
    def undocumented(self) -> bool:
        return self.value.startswith(NOT_DOCUMENTED)

    @property
    def brief(self) -> str:
        return self.short or ("n.d." if self.undocumented else self.value)


FRAMEWORKS: tuple[Framework, ...] = (
    Framework(
        "vLLM",
        "a library and server for LLM inference",
        "Begun at UC Berkeley's Sky Computing Lab, now community-driven; an OpenAI-compatible server "
        "on NVIDIA, AMD, Intel, TPU and other back ends, with many speculative methods and "
        "quantization formats.",
        "Many users on datacenter accelerators behind an OpenAI-compatible API. Its stated aim is "
        "easy, fast and cheap serving for everyone: the usual first choice when no constraint "
        "points elsewhere.",
        ("vllm_docs_index", "vllm_spec_decode", "vllm_quantization"),
    ),
    Framework(
        "SGLang",
        "a serving framework (runtime plus frontend language)",
        "A serving framework for language and vision-language models that co-designs the runtime "
        "with a frontend language; RadixAttention reuses KV cache across calls automatically.",
        "Multi-user GPU serving where requests share prefixes (chat history, agents, few-shot "
        "prompts, structured programs), and large MoE deployments with expert parallelism and "
        "prefill/decode disaggregation.",
        ("sglang_docs_index", "sglang_expert_parallel", "sglang_pd_disagg"),
    ),
    Framework(
        "TGI",
        "a Rust, Python and gRPC server",
        "Hugging Face's Text Generation Inference, which powered Hugging Chat and Inference "
        "Endpoints. In maintenance mode: only minor fixes and documentation are accepted, and its "
        "docs recommend vLLM, SGLang, llama.cpp or MLX instead.",
        "Keeping an existing TGI deployment running; for a new one its own docs point to vLLM or "
        "SGLang (servers) and llama.cpp or MLX (local).",
        ("tgi_docs_index",),
    ),
    Framework(
        "TensorRT-LLM",
        "NVIDIA's serving library for its GPUs",
        "NVIDIA's library; its default backend is now PyTorch (the older TensorRT-engine path "
        "documents the Medusa, ReDrafter and lookahead variants), and its support matrices list "
        "NVIDIA GPUs only (Ampere to Blackwell).",
        "An all-NVIDIA fleet that wants FP8/FP4 on Hopper and Blackwell, disaggregated serving and "
        "wide expert parallelism from the vendor, accepting the lock-in.",
        ("trtllm_quantization", "trtllm_spec_legacy", "trtllm_parallelism"),
    ),
    Framework(
        "llama.cpp",
        "a C/C++ engine on the ggml library",
        "LLM inference in C/C++ with minimal setup on a wide range of hardware: Apple silicon first "
        "class, x86 and RISC-V CPUs, CUDA, HIP, Vulkan, SYCL and more; CPU+GPU hybrid runs for models "
        "larger than VRAM; GGUF files quantized to 1.5-8 bits; llama-server serves several users.",
        "One user (or a few) on a laptop, desktop, Mac or CPU-only machine, or a model larger than "
        "the GPU's memory; GGUF weights; full control over every knob.",
        ("llamacpp_readme", "llamacpp_server"),
    ),
    Framework(
        "Ollama",
        "a local model runner built on llama.cpp",
        "Runs open models locally (and larger ones in Ollama's cloud) behind a CLI and a REST API; "
        "its README names llama.cpp as its supported backend. By default each model serves one "
        "request at a time (OLLAMA_NUM_PARALLEL=1).",
        "The quickest local setup: pull a model by name and call a local API; the same hardware "
        "niche as llama.cpp with fewer knobs.",
        ("ollama_readme", "ollama_faq"),
    ),
)

# Two more engines a reader may pick, described in the pick guide but not charted in the feature
# table (their cells are not read yet): MLX LM on Apple silicon, LMDeploy on NVIDIA GPUs.
ALSO_PICKED: tuple[Framework, ...] = (
    Framework(
        "MLX LM",
        "a Python package on Apple's MLX array framework",
        "Generates text with and fine-tunes LLMs on Apple silicon: models from the Hugging Face Hub, "
        "quantized (and uploaded) by one command, LoRA and full fine-tuning of quantized models, "
        "distributed inference over several Macs with mx.distributed.",
        "A Mac with Apple silicon, the unified memory holding the whole model; the MLX community's "
        "converted 4- and 8-bit models.",
        ("mlx_lm_readme",),
    ),
    Framework(
        "LMDeploy",
        "a toolkit for compressing, deploying and serving LLMs and VLMs",
        "Two engines, TurboMind (CUDA, built from NVIDIA's FasterTransformer) and a PyTorch engine; "
        "persistent (continuous) batching, a blocked (paged) KV cache, dynamic split-and-fuse "
        "(chunked prefill), tensor parallelism, weight-only (AWQ, 4-bit) and K/V quantization, "
        "prefill/decode disaggregation.",
        "NVIDIA GPUs serving the model families its TurboMind kernels target (InternLM, Qwen, Llama "
        "and vision-language models), and 4-bit AWQ serving.",
        ("lmdeploy_docs",),
    ),
)

FEATURES: tuple[Feature, ...] = (
    Feature("paged_kv", "Paged KV cache", 6, "paged KV"),
    Feature("prefix_cache", "Prefix / radix (automatic prefix) caching", 6, "prefix cache"),
    Feature("kv_quant", "KV-cache quantization", 5, "KV quant"),
    Feature("continuous_batching", "Continuous (in-flight) batching", 13, "cont. batching"),
    Feature("chunked_prefill", "Chunked prefill", 13, "chunked prefill"),
    Feature("spec_draft", "Speculative decoding: draft model", 7, "spec: draft"),
    Feature("spec_ngram", "Speculative decoding: n-gram / prompt lookup", 8, "spec: n-gram"),
    Feature("spec_medusa", "Medusa heads", 9, "spec: Medusa"),
    Feature(
        "spec_eagle",
        "EAGLE draft heads",
        9,
        "spec: EAGLE",
        "not built in the book; closest to chapter 9's heads that draft from the model's own states",
    ),
    Feature("spec_lookahead", "Lookahead (Jacobi) decoding", 9, "spec: lookahead"),
    Feature("weight_quant", "Weight quantization formats", 12, "weight quant"),
    Feature("disaggregation", "Prefill/decode disaggregation", 14, "P/D disagg."),
    Feature("tensor_parallel", "Tensor parallelism", 15, "tensor par."),
    Feature("pipeline_parallel", "Pipeline parallelism", 15, "pipeline par."),
    Feature("expert_parallel", "Expert parallelism (MoE)", 15, "expert par."),
    Feature("context_parallel", "Context / sequence parallelism", 15, "context par."),
)

ND = Cell(NOT_DOCUMENTED)


def _row(*cells: Cell) -> dict[str, Cell]:
    return dict(zip((f.name for f in FRAMEWORKS), cells, strict=True))


_TABLE: dict[str, dict[str, Cell]] = {
    "paged_kv": _row(
        Cell("yes (PagedAttention)", ("vllm_docs_index",), "yes"),
        Cell("yes (token attention, i.e. paged)", ("sglang_docs_index",), "yes"),
        Cell("yes (vLLM's kernels)", ("tgi_paged_attention",), "yes"),
        Cell("yes (paged or contiguous KV cache)", ("trtllm_ifb_paged",), "yes"),
        ND,
        ND,
    ),
    "prefix_cache": _row(
        Cell("yes: automatic prefix caching (hashed blocks)", ("vllm_apc",), "yes (APC)"),
        Cell("yes: RadixAttention", ("sglang_docs_index",), "yes (radix)"),
        Cell("yes (v3 prefix cache)", ("tgi_v3_chunking",), "yes"),
        Cell("yes: KV block reuse in a radix tree, on by default", ("trtllm_kvcache",), "yes (radix)"),
        Cell(
            "partial: per-slot prompt cache (--cache-prompt), reuse by KV shifting (--cache-reuse)",
            ("llamacpp_server",),
            "partial",
        ),
        ND,
    ),
    "kv_quant": _row(
        Cell("yes: quantized KV cache", ("vllm_quantization",), "yes"),
        Cell("yes: FP8 / FP4 KV cache (per attention backend)", ("sglang_attention_backend",), "FP8, FP4"),
        Cell("yes: fp8_e4m3fn, fp8_e5m2 (CUDA)", ("tgi_launcher",), "FP8"),
        Cell("yes: FP8 KV cache", ("trtllm_quantization",), "FP8"),
        Cell("yes: q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1", ("llamacpp_server", "llamacpp_multigpu"), "q8_0, q4_0.."),
        Cell("yes: q8_0, q4_0 (with flash attention)", ("ollama_faq",), "q8_0, q4_0"),
    ),
    "continuous_batching": _row(
        Cell("yes", ("vllm_docs_index",)),
        Cell("yes", ("sglang_docs_index",)),
        Cell("yes", ("tgi_docs_index",)),
        Cell("yes (in-flight batching)", ("trtllm_ifb_paged",), "yes (IFB)"),
        Cell("yes (--cont-batching, on by default)", ("llamacpp_server",), "yes"),
        Cell("partial: parallel requests per model (OLLAMA_NUM_PARALLEL, default 1)", ("ollama_faq",), "partial"),
    ),
    "chunked_prefill": _row(
        Cell("yes", ("vllm_docs_index",)),
        Cell("yes (--chunked-prefill-size)", ("sglang_docs_index", "sglang_pipeline_parallel"), "yes"),
        Cell("yes (v3 chunking)", ("tgi_v3_chunking",), "yes"),
        Cell("yes (chunked context)", ("trtllm_ifb_paged",), "yes"),
        ND,
        ND,
    ),
    "spec_draft": _row(
        Cell("yes", ("vllm_spec_decode",)),
        Cell("yes (STANDALONE)", ("sglang_spec_decode",), "yes"),
        Cell("no: the docs list only Medusa and n-gram", ("tgi_speculation",), "no"),
        Cell("yes (draft/target)", ("trtllm_spec_decode",), "yes"),
        Cell("yes (--model-draft)", ("llamacpp_speculative",), "yes"),
        Cell("partial: draft_num_predict, when a draft model is available", ("ollama_modelfile",), "partial"),
    ),
    "spec_ngram": _row(
        Cell("yes: n-gram, suffix decoding", ("vllm_spec_decode",), "n-gram, suffix"),
        Cell("yes: NGRAM (CUDA only)", ("sglang_spec_decode",), "yes"),
        Cell("yes: n-gram (--speculate)", ("tgi_speculation",), "yes"),
        Cell("yes: NGram (prompt lookup), suffix automaton", ("trtllm_spec_decode",), "yes"),
        Cell("yes: ngram-cache, ngram-simple, ngram-map, ngram-mod", ("llamacpp_speculative",), "yes (4 kinds)"),
        ND,
    ),
    "spec_medusa": _row(
        ND,
        ND,
        Cell("yes", ("tgi_speculation",)),
        Cell("partial: TensorRT-engine backend only", ("trtllm_spec_legacy", "trtllm_spec_decode"), "legacy only"),
        ND,
        ND,
    ),
    "spec_eagle": _row(
        Cell("yes: EAGLE, EAGLE-3 (also MTP)", ("vllm_spec_decode",), "yes"),
        Cell("yes: EAGLE-2, EAGLE-3 (also MTP)", ("sglang_spec_decode",), "yes"),
        ND,
        Cell(
            "yes: EAGLE-3 (EAGLE-1/2 on the TensorRT-engine backend)",
            ("trtllm_spec_decode", "trtllm_spec_legacy"),
            "EAGLE-3",
        ),
        ND,
        ND,
    ),
    "spec_lookahead": _row(
        ND,
        ND,
        ND,
        Cell("partial: TensorRT-engine backend only", ("trtllm_spec_legacy",), "legacy only"),
        Cell("partial: example program (llama-lookahead)", ("llamacpp_lookahead",), "example only"),
        ND,
    ),
    "weight_quant": _row(
        Cell(
            "GPTQ, AWQ, INT4, INT8, FP8, GGUF, bitsandbytes, and more",
            ("vllm_docs_index", "vllm_quantization"),
            "GPTQ AWQ FP8..",
        ),
        Cell(
            "FP8, MXFP4/NVFP4, INT8, AWQ, GPTQ, GGUF, bitsandbytes, and more",
            ("sglang_quantization",),
            "FP8 FP4 AWQ..",
        ),
        Cell(
            "GPTQ, AWQ, Marlin, EXL2, EETQ, bitsandbytes, fp8; GGUF via the llama.cpp backend",
            ("tgi_quantization", "tgi_llamacpp_backend"),
            "GPTQ AWQ fp8..",
        ),
        Cell("NVFP4, MXFP4, FP8, W4A16/W4A8 AWQ and GPTQ", ("trtllm_quantization",), "FP4 FP8 AWQ.."),
        Cell(
            "GGUF: Q8_0, k-quants (Q2_K..Q6_K), i-quants (IQ1..IQ4), 1.5 to 8 bits",
            ("llamacpp_readme", "llamacpp_quantize"),
            "GGUF k/i-quants",
        ),
        Cell("GGUF; ollama create --quantize q8_0, q4_K_S, q4_K_M", ("ollama_import",), "GGUF q4_K, q8_0"),
    ),
    "disaggregation": _row(
        Cell("partial: experimental", ("vllm_disagg_prefill",), "experimental"),
        Cell("yes", ("sglang_pd_disagg",)),
        ND,
        Cell("yes", ("trtllm_disagg",)),
        ND,
        ND,
    ),
    "tensor_parallel": _row(
        Cell("yes", ("vllm_docs_index",)),
        Cell("yes (--tp)", ("sglang_docs_index",), "yes"),
        Cell("yes (--num-shard), supported models only", ("tgi_tensor_parallelism",), "yes"),
        Cell("yes", ("trtllm_parallelism",)),
        Cell("partial: --split-mode tensor (experimental)", ("llamacpp_multigpu",), "experimental"),
        ND,
    ),
    "pipeline_parallel": _row(
        Cell("yes", ("vllm_docs_index",)),
        Cell("yes", ("sglang_pipeline_parallel",)),
        ND,
        Cell("yes", ("trtllm_parallelism",)),
        Cell("yes: --split-mode layer, the default", ("llamacpp_multigpu",), "yes (default)"),
        Cell("?: a model too big for one GPU is spread over all (kind not stated)", ("ollama_faq",), "?"),
    ),
    "expert_parallel": _row(
        Cell("yes", ("vllm_docs_index",)),
        Cell("yes (DeepEP, EPLB)", ("sglang_expert_parallel",), "yes"),
        ND,
        Cell("yes (EP, wide EP)", ("trtllm_parallelism",), "yes"),
        ND,
        ND,
    ),
    "context_parallel": _row(
        Cell(
            "partial: decode context parallel; prefill context parallel in development",
            ("vllm_context_parallel",),
            "partial (decode)",
        ),
        ND,
        ND,
        Cell("yes (context parallel, Helix)", ("trtllm_parallelism",), "yes"),
        ND,
        ND,
    ),
}

SUPPORT: dict[tuple[str, str], Cell] = {
    (feature, framework): cell for feature, row in _TABLE.items() for framework, cell in row.items()
}


def framework(name: str) -> Framework:
    """The framework called ``name``."""
    for fw in FRAMEWORKS:
        if fw.name == name:
            return fw
    raise ValueError(f"unknown framework {name!r}; known: {[fw.name for fw in FRAMEWORKS]}")
