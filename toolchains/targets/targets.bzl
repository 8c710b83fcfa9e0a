"""The rule set's compilation targets: toolchains/targets/<name>.json each (a test checks the list is complete)."""

RULE_SET_TARGETS = [
    "aarch64-neoverse-v2",
    "aarch64-orin",
    "aarch64-pi5",
    "cuda-sm_80",
    "cuda-sm_86",
    "cuda-sm_87",
    "cuda-sm_89",
    "cuda-sm_90",
    "riscv64-rvv",
    "rocm-gfx1100",
    "rocm-gfx942",
    "vulkan-adreno",
    "vulkan-rdna3",
    "x86_64-v3",
    "x86_64-v4",
    "x86_64-v4-bf16",
]
