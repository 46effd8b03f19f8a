"""The runtime: needs numpy, onnxruntime, tokenizers, safetensors — never torch or transformers."""

from .model import Model, load
from .options import GenerationOptions, GenerationResult
from .session import ChatSession

__all__ = ["ChatSession", "GenerationOptions", "GenerationResult", "Model", "load"]
