"""hexforge: Hugging Face LLMs/VLMs on the Qualcomm Hexagon NPU.

    hexforge.load(bundle, backend="cpu").generate("prompt")
"""

__version__ = "0.1.0"


def load(bundle, backend: str = "cpu", arch: str | int | None = None, target: str | None = None,
         allow_cpu_fallback: bool = False, check_digests: bool | None = None,
         prefill_mode: str = "chunked", dialog: str = "basic"):
    """Load a built bundle -> ``hexforge.runtime.Model`` (its ``generate`` / ``stream`` / ``chat``
    take the typed keywords of ``hexforge.runtime.GenerationOptions``). backend: cpu | qnn |
    qnn-sim | auto | genie (the bundle's Genie folder through libGenie: a ``GenieModel`` of
    runtime/genie/model.py, the same methods); arch: the device's Hexagon arch (e.g. "v81") for
    HTP targets; target: a bundle target by name (default: the backend's); allow_cpu_fallback:
    HTP nodes the device does not claim run on the CPU instead of refusing to load;
    check_digests: every file's SHA-256 against the manifest (True), only where this machine has
    not verified the file as it is now (None, the default), or sizes alone (False);
    prefill_mode: "chunked" (the AR-N prefill graphs) or "decode" (prompts through the AR-1
    graph; the prefill graphs are opened only if a request asks for them); dialog (backend
    genie): "basic", or "lade" (Genie's lookahead decoding, on a folder built with --genie-kv
    lade: basic's tokens in fewer steps)."""
    from .runtime import load as _load

    return _load(bundle, backend, arch, target, allow_cpu_fallback, check_digests, prefill_mode,
                 dialog)
