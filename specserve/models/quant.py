"""Run-time weight formats (``--quantization``); kept free of heavy imports for the CLI."""

QUANTIZATIONS = ("auto", "none", "int8", "q4", "q4_0")
# auto:  q4 on CPU, none on CUDA
# none:  fp32 (CPU) / the activation dtype (CUDA)
# int8:  per-channel int8
# q4:    GGUF blocks our kernels read kept as stored, other types re-quantized to int8
# q4_0:  every linear weight in 4 bits: Q4_0 / Q4_1 / Q4_K kept, the rest re-quantized to Q4_0
#        (smallest and fastest; lossy against the file, meant for draft models)
