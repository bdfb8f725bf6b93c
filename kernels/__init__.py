"""Duplex kernels. Each kernel is a triple: triton kernel, launcher with plain-words asserts,
torch reference. The engine calls `kernels.ops`, which picks triton on CUDA and the torch
reference (or, in batch-invariant mode, `kernels.batch_invariant`) on CPU.

    ops.py              dispatch: store_kv, paged_attention, rms_norm, rotary_embedding,
                        matmul, linear, log_softmax, silu, silu_and_mul,
                        fused_moe
    kv_store.py         paged KV cache write (slot = block_id * block_size + offset)
    attention.py        varlen paged attention: decode + prefill over a cached prefix, GQA,
                        sliding window, soft cap
    decode_attention.py split-KV (flash-decoding) triton attention for decode rows (CUDA)
    activation.py       SiLU-and-mul of a fused gate/up projection
    fused_moe.py        routed SwiGLU experts as grouped GEMMs over expert-sorted rows
    rms_norm.py         RMSNorm (Llama / Gemma3 offset), fused residual add
    rotary.py           RoPE from a cos/sin cache (neox and GPT-J layouts)
    matmul.py           plain matmul/linear; batch-invariant persistent triton matmul
    batch_invariant.py  the batch-invariant switch and its CPU implementations
    _triton.py          the optional triton import
"""
