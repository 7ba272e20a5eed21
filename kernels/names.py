"""The kernel choices a user can name (RTPKV_ATTENTION, RTPKV_LINEAR, RTPKV_ISA, WEIGHT_TYPE): one
list each, read by the configuration's validation and by the dispatch (WEIGHT_TYPE's by
kernels/weight_types.py's registry)."""

ATTENTION_BACKENDS = ("auto", "cpu-paged", "flash-attn", "torch", "triton")
LINEAR_PATHS = ("auto", "native", "onednn", "fp32-compute", "avx2")
ISA_LEVELS = ("auto", "avx2", "avx512")
WEIGHT_TYPES = ("auto", "int8", "w8a8_int8", "bf16")
