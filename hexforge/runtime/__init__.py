"""The runtime: needs numpy, onnxruntime, tokenizers, safetensors — never torch or transformers."""

from .model import ChatSession, GenerationOptions, GenerationResult, Model, load

__all__ = ["ChatSession", "GenerationOptions", "GenerationResult", "Model", "load"]
