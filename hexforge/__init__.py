"""hexforge: Hugging Face LLMs/VLMs on the Qualcomm Hexagon NPU.

    hexforge.load(bundle, backend="cpu").generate("prompt")
"""

__version__ = "0.1.0"


def load(bundle, backend: str = "cpu", **kw):
    """Load a built bundle; see hexforge.runtime.load (backend cpu | qnn | qnn-sim | auto)."""
    from .runtime import load as _load

    return _load(bundle, backend, **kw)
