"""The build's HTP targets: the stage (calibrate, quantize, compile per arch), the QNN compile, the
compiled graphs' checks, the per-tensor probe, and Hextimate's estimates."""
