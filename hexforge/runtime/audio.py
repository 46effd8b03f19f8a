"""Host audio preprocessing (numpy, no torch): waveform -> log-mel features -> audio graph inputs.

Each class takes its EncoderSpec params and maps a float32 mono waveform at its ``sampling_rate``
(runtime/media.py load_audio) to ``({input key: array [1, ...] fixed shape}, n soft tokens)``,
exactly as the HF feature extractor.
"""

from __future__ import annotations

import numpy as np

# ---- Gemma-4 (transformers Gemma4AudioFeatureExtractor) ------------------------------------------
#
#   waveform [L] f32 ─zero-pad to the fixed window W (a multiple of pad_to_multiple_of, as HF pads)
#     ─semicausal left pad frame_length // 2─▶ frames [F, frame_length + 1], hop hop_length
#     ─(preemphasis) · periodic Hann─▶ |rfft(n = fft_length)| @ mel (HTK, no norm) ─▶ log(· + floor)
#     ─(per-bin mean / stddev)─▶ input_features [1, F, n_mels] (0 on frames that are not all real)
#   input_features_mask [1, F] f32: 1.0 where HF's frame mask is True (the frame's last sample is
#   real audio), 0.0 elsewhere. Valid frames only read real samples, so padding to W instead of to
#   HF's own multiple of 128 changes no valid number: HF's features are ours cut at its length.
#   n soft tokens: the mask after the encoder's two stride-2 subsamplings (mask[::2][::2]) summed —
#   what HF's Gemma4Processor.replace_audio_token and the audio tower's attention_mask give.
#   mask_after_cnn [1, F/2], soft_token_mask [1, S] f32: mask[::2] and mask[::2][::2] (a Genie
#   audio node takes them: families/gemma4_audio.py GenieAudioNode).


def _hertz_to_mel_htk(freq):
    return 2595.0 * np.log10(1.0 + (freq / 700.0))


def _mel_to_hertz_htk(mels):
    return 700.0 * (np.power(10, mels / 2595.0) - 1.0)


def mel_filter_bank_htk(num_frequency_bins: int, num_mel_filters: int, min_frequency: float,
                        max_frequency: float, sampling_rate: int) -> np.ndarray:
    """transformers ``audio_utils.mel_filter_bank(norm=None, mel_scale="htk")``, float64
    [num_frequency_bins, num_mel_filters]: triangles in Hz between HTK-mel-spaced centres."""
    mel_freqs = np.linspace(_hertz_to_mel_htk(min_frequency), _hertz_to_mel_htk(max_frequency),
                            num_mel_filters + 2)
    filter_freqs = _mel_to_hertz_htk(mel_freqs)  # [M + 2] Hz
    fft_freqs = np.linspace(0, sampling_rate // 2, num_frequency_bins)  # [B] Hz
    filter_diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]  # [B, M + 2]
    down = -slopes[:, :-2] / filter_diff[:-1]
    up = slopes[:, 2:] / filter_diff[1:]
    return np.maximum(np.zeros(1), np.minimum(down, up))


class Gemma4AudioPrep:
    """transformers ``Gemma4AudioFeatureExtractor`` (no dither: inference is deterministic) padded
    to a fixed window, plus the frame validity mask the static audio graph reads.

    params (the feature extractor's resolved attributes, families/gemma4_audio.py writes them):
    sampling_rate, feature_size (mel bins), frame_length and hop_length (samples), fft_length,
    min_frequency, max_frequency, preemphasis, preemphasis_htk_flavor, input_scale_factor,
    mel_floor, per_bin_mean / per_bin_stddev (lists or None), pad_to_multiple_of (HF's 128),
    max_seconds (the window: longer audio is refused, never truncated as HF would)."""

    def __init__(self, params: dict):
        from ..bundle.errors import BundleError

        def get(name: str, kind, default=None, optional: bool = False):
            value = params.get(name, default)
            if optional and value is None:
                return None
            if value is None or isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
                raise BundleError(f"gemma4_audio: parameter {name} must be a "
                                  f"{getattr(kind, '__name__', 'number')}, got {value!r}")
            return value

        num = (int, float)
        self.sampling_rate: int = get("sampling_rate", int)
        self.n_mels: int = get("feature_size", int)
        self.frame_length: int = get("frame_length", int)
        self.hop_length: int = get("hop_length", int)
        self.fft_length: int = get("fft_length", int)
        self.min_frequency = float(get("min_frequency", num))
        self.max_frequency = float(get("max_frequency", num))
        self.preemphasis = float(get("preemphasis", num, 0.0))
        self.preemphasis_htk_flavor: bool = get("preemphasis_htk_flavor", bool, True)
        self.input_scale_factor = float(get("input_scale_factor", num, 1.0))
        self.mel_floor = float(get("mel_floor", num))
        self.pad_to_multiple_of: int = get("pad_to_multiple_of", int, 128)
        self.max_seconds = float(get("max_seconds", num))
        mean = get("per_bin_mean", list, optional=True)
        std = get("per_bin_stddev", list, optional=True)
        if (min(self.sampling_rate, self.n_mels, self.frame_length, self.hop_length,
                self.pad_to_multiple_of) < 1 or self.fft_length < self.frame_length
                or not self.max_seconds > 0 or not self.mel_floor > 0):
            raise BundleError(f"gemma4_audio: bad parameters {params!r}")
        for name, v in (("per_bin_mean", mean), ("per_bin_stddev", std)):
            if v is not None and len(v) != self.n_mels:
                raise BundleError(f"gemma4_audio: {name} has {len(v)} values for {self.n_mels} bins")
        # as HF: float64 [1, 1, n_mels] (the subtraction / division then runs in float64)
        self.per_bin_mean = None if mean is None else np.asarray(mean, np.float64).reshape(1, 1, -1)
        self.per_bin_stddev = None if std is None else np.asarray(std, np.float64).reshape(1, 1, -1)
        # periodic Hann (HF window_function: np.hanning(N + 1)[:-1]), float32 as HF keeps it
        self.window = np.hanning(self.frame_length + 1)[:-1].astype(np.float32)
        self.mel_filters = mel_filter_bank_htk(self.fft_length // 2 + 1, self.n_mels,
                                               self.min_frequency, self.max_frequency,
                                               self.sampling_rate)  # [fft/2 + 1, n_mels] f64
        self.max_samples = round(self.max_seconds * self.sampling_rate)
        m = self.pad_to_multiple_of
        self.window_samples = -(-self.max_samples // m) * m  # HF pads to a multiple of m
        self.num_frames = self.frames_for(self.window_samples)
        if self.num_frames < 1:
            raise BundleError(f"gemma4_audio: a {self.max_seconds:g} s window holds no mel frame")

    # ---- the arithmetic of HF's framing and of the encoder's subsampling ----
    def frames_for(self, padded_samples: int) -> int:
        """Mel frames HF makes from ``padded_samples`` (after its pad to a multiple of 128)."""
        return (padded_samples + self.frame_length // 2 - (self.frame_length + 1)) // self.hop_length + 1

    @property
    def max_soft_tokens(self) -> int:
        """Rows of the encoder output: F frames through two stride-2 (kernel 3, pad 1) convs."""
        t = self.num_frames
        for _ in range(2):
            t = (t - 1) // 2 + 1
        return t

    def _log_mel(self, waveform: np.ndarray) -> np.ndarray:
        """HF ``_extract_spectrogram`` on one padded waveform [W] f32 -> [F, n_mels] f32."""
        x = waveform[None]  # [1, W]
        if self.input_scale_factor != 1.0:
            x = x * self.input_scale_factor
        pad_left = self.frame_length // 2  # semicausal: first frame centred at t = 0
        x = np.pad(x, ((0, 0), (pad_left, 0)))
        size = self.frame_length + 1
        n = (x.shape[1] - size) // self.hop_length + 1
        frames = np.lib.stride_tricks.as_strided(
            x, shape=(1, n, size), strides=(x.strides[0], x.strides[1] * self.hop_length, x.strides[1]))
        if self.preemphasis > 0.0:
            p = self.preemphasis
            if self.preemphasis_htk_flavor:
                frames = np.concatenate([frames[..., :1] * (1.0 - p),
                                         frames[..., 1:-1] - p * frames[..., :-2]], axis=-1)
            else:
                frames = frames[..., 1:] - p * frames[..., :-1]
        else:
            frames = frames[..., :-1]
        # same dtypes as HF: f32 frames · f32 window, rfft (complex64 in numpy >= 2), |.| @ f64 mel
        spec = np.abs(np.fft.rfft(frames * self.window, n=self.fft_length, axis=-1))  # [1, F, B]
        log_mel = np.log(np.matmul(spec, self.mel_filters) + np.float64(self.mel_floor))
        if self.per_bin_mean is not None:
            log_mel = log_mel - self.per_bin_mean
        if self.per_bin_stddev is not None:
            log_mel = log_mel / self.per_bin_stddev
        return log_mel[0].astype(np.float32)

    def __call__(self, waveform: np.ndarray) -> tuple[dict[str, np.ndarray], int]:
        from ..bundle.errors import MediaError

        wav = np.asarray(waveform)
        if wav.ndim != 1 or not np.issubdtype(wav.dtype, np.floating):
            raise MediaError(f"gemma4_audio expects mono float samples [N] (runtime/media.py "
                             f"load_audio), got {wav.dtype} {list(wav.shape)}")
        L = wav.shape[0]
        sr = self.sampling_rate
        if L == 0:
            raise MediaError("the audio is empty (0 samples)")
        if L > self.max_samples:
            raise MediaError(f"the audio is {L / sr:.2f} s long, longer than this model's "
                             f"{self.max_seconds:g} s audio window; trim it or split it")
        if not np.isfinite(wav).all():
            raise MediaError("the audio holds NaN or infinite samples")
        padded = np.zeros(self.window_samples, np.float32)  # HF casts float64 input to float32
        padded[:L] = wav
        F = self.num_frames
        # HF frame mask: frame i is real iff its last sample (i·hop + frame_length in the
        # left-padded signal) is a real sample, i.e. < L + pad_left
        ends = np.arange(F) * self.hop_length + self.frame_length
        valid = ends < L + self.frame_length // 2  # [F] bool
        n_soft = int(valid[::2][::2].sum())
        if n_soft == 0:
            need = (self.frame_length - self.frame_length // 2 + 1) / sr
            raise MediaError(f"the audio is {L / sr * 1000:.1f} ms long, too short for one mel frame "
                             f"(at least {need * 1000:.1f} ms)")
        features = self._log_mel(padded) * valid[:, None]  # [F, n_mels]; HF zeroes invalid frames
        inputs = {"input_features": features[None].astype(np.float32),
                  "input_features_mask": valid[None].astype(np.float32),
                  # the masks after the first conv and of the soft tokens (a Genie audio node's)
                  "mask_after_cnn": valid[None, ::2].astype(np.float32),
                  "soft_token_mask": valid[None, ::2][:, ::2].astype(np.float32)}
        return inputs, n_soft
