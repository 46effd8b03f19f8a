"""Host audio preprocessing (numpy, no torch): waveform -> log-mel features -> audio graph inputs.

Each class takes its EncoderSpec params and maps a float32 mono waveform at its ``sampling_rate``
(runtime/media.py load_audio) to ``({input key: array [1, ...] fixed shape}, n soft tokens)``,
exactly as the HF feature extractor.
"""

from __future__ import annotations

import numpy as np
