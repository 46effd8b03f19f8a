"""Host image preprocessing (numpy + pillow, no torch): decoded image -> vision graph inputs.

Each class takes its EncoderSpec params and maps a PIL RGB image (runtime/media.py load_image) to
``({input key: array [1, ...] fixed shape}, n soft tokens)``, exactly as the HF image processor.
"""

from __future__ import annotations

import numpy as np

# ---- Gemma-4 (transformers Gemma4ImageProcessorPil) ----------------------------------------------


# ---- Qwen2-VL / Qwen3-VL (transformers Qwen2VLImageProcessorPil) ---------------------------------
