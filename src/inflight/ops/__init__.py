"""The small fused operations of a decoder layer (rotary embedding, residual add
+ RMSNorm, SiLU-and-multiply) and paged attention: a reference
implementation in PyTorch and C kernels for float32 on the CPU."""
