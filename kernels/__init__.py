"""Triton kernels, each beside the PyTorch reference it must equal.

- ``flash_attention``: fused attention forward, FlashAttention-2 style (Dao, 2023), with
  ``attention_tiled``, the same online-softmax algorithm in plain PyTorch.
- ``paged_attention``: the decode kernel that reads K/V through block tables (PagedAttention,
  Kwon et al., 2023), against ``minillm.kv.paged.paged_attention_decode``.
- ``rmsnorm``: RMSNorm fused with the residual add, against ``minillm.core.model.rms_norm_reference``.
- ``dispatch``: the ``"triton"`` attention backend of ``minillm.core.model``, with its SDPA fallback.
- ``gpu_check``: correctness and speed on a CUDA machine (``make gpu-check``).

Nothing here is imported by ``import kernels``: triton loads only when a kernel module is used.
"""
