"""Triton kernels and the CPU's C kernels, a leaf: they import torch and triton, never minillm.

- ``flash_attention``: fused attention forward, FlashAttention-2 style (Dao, 2023); its plain
  PyTorch twin, ``attention_tiled``, and the other references sit in ``minillm.core.attention``.
- ``paged_attention``: the decode kernel that reads K/V through block tables (PagedAttention,
  Kwon et al., 2023), against ``minillm.kv.paged.paged_attention_decode``.
- ``rmsnorm``: RMSNorm fused with the residual add, against ``minillm.core.model.rms_norm_reference``.
- ``quant_matmul``: weight-only int8 / int4 / fp8 matmul that dequantizes in registers, against
  dequantize-then-``F.linear`` (``minillm.compression.quant``); ``minillm.compression.cuda_kernels``
  chooses between it and PyTorch's own packed kernels.
- ``native`` with ``quant_matvec.c``: the CPU's decode-sized int8, W8A8 and int4 products in C
  (AVX2 where the CPU has it), built with the machine's compiler on first use; their torch ops
  and the choice between them and PyTorch's kernels are ``minillm.compression.cpu_kernels``.

The ``"triton"`` attention backend that picks the kernel or falls back to SDPA is
``minillm.core.attention``; correctness and speed on a CUDA machine are ``minillm.bench.gpu``
(``make gpu-check``). Nothing here is imported by ``import minillm.kernels``: triton loads only
when a kernel module is used.
"""
