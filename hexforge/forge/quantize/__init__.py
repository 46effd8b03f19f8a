"""The build's quantization: the recipes, weight-only MatMulNBits, calibration (its text and
statistics), the QDQ pass with its weight formats (GPTQ), the tied embedding stored once."""
