"""The runtime: needs numpy, onnxruntime, tokenizers, safetensors — never torch or transformers."""

from .model import GenerationResult, Model, load

__all__ = ["GenerationResult", "Model", "load"]
