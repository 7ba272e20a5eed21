"""The kernel choices a user can name (RTPKV_ATTENTION, RTPKV_LINEAR, RTPKV_ISA): one list each,
read by the configuration's validation and by the dispatch."""

ATTENTION_BACKENDS = ("auto", "cpu-paged", "flash-attn", "torch")
LINEAR_PATHS = ("auto", "native", "onednn", "fp32-compute", "avx2")
ISA_LEVELS = ("auto", "avx2", "avx512")
