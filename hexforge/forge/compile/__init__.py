"""The HTP targets' build stages: calibration statistics, the quantization recipes and the QDQ
pass with its weight formats (GPTQ), the QNN compile, and the per-tensor accuracy probe."""
