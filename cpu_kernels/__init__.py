"""CPU kernels XLA:CPU lacks, as XLA FFI custom calls compiled on the machine that runs them.

int8_dot.cc: a few int8 rows times a row-major int8 weight, exact int32 sums: w8a8's decode
matmul (XLA:CPU's int8 dot streams the weight slowly at a handful of rows and takes a slow path
for one). int4_dot.cc: a few float rows times a group-wise int4 weight read as its packed
nibbles, the activations rounded to int8 per group as llama.cpp's Q4 x Q8 dot does: int4's decode
matmul (XLA widens the weight to float in front of its dot). build.py compiles the C++ once per machine and source (-march=native, so the CPU's own
vector instructions), keeps the shared library in the cache folder and registers its handlers
with JAX; without a C++ compiler, or with JAXSERVE_CPU_KERNELS=0, the callers keep XLA's dot.
"""
