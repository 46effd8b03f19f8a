"""The build's export: float ONNX graphs per shard plan (prefill, decode, verify, head, the media
towers), their weights shared, fused and folded; host.safetensors written."""
