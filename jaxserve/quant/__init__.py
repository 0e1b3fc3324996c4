"""Host-side quantization: turning float weights into int8 / int4 / fp8 QuantizedTensors, the
calibration pass that finds activation and KV scales on real text, and the quantized checkpoint.

What runs inside the compiled step (the quantized matmul, the KV dequantization) lives beside the
code it belongs to (jaxserve/models/linear.py, pallas_kernels/kv_quant.py), so that an
edit there invalidates the executable cache as any traced code does; nothing here is traced.
"""

from .spec import QUANTIZATION_MODES, QuantSpec

__all__ = ["QUANTIZATION_MODES", "QuantSpec"]
