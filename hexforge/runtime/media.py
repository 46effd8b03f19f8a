"""Media decoders for multimodal requests: untrusted image / audio files -> arrays (no torch).

Both read the *header* first and refuse what they will not decode before any pixel or frame is
decoded, so a bomb, a lie about its size or a file that is not media costs a few KB of reading:

    load_image  pillow, formats allow-listed (Pillow's EPS plugin would start ghostscript; exotic
                parsers are attack surface), width x height checked against ``max_pixels`` from the
                header, then decoded, EXIF-rotated and made RGB the way HF processors do
                (``transformers.image_utils.load_image`` + ``image_transforms.convert_to_rgb``:
                transparency composited onto white).
    load_audio  soundfile (libsndfile), formats allow-listed; duration = frames / rate from the
                header checked against ``max_seconds``; then at most that many frames are read
                (a header that under-states its length cannot make us read more), mixed to mono
                and resampled exactly as ``transformers.audio_utils.load_audio`` does (the
                channel mean, soxr ``soxr_hq``: ``mono_resampled``).

Every refusal is a ``MediaError`` (a RequestError: HTTP 400, CLI exit 2) with a one-line message.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import warnings
from pathlib import Path
from typing import IO

import numpy as np

from ..bundle.errors import MediaError

IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF")
AUDIO_FORMATS = ("WAV", "WAVEX", "W64", "RF64", "FLAC", "OGG", "MP3", "AIFF")
MAX_AUDIO_CHANNELS = 32
AUDIO_RATES = (1_000, 768_000)  # Hz; outside this a header is lying or the file is not speech


def _open_source(source: str | os.PathLike | bytes, what: str) -> tuple[IO[bytes], str]:
    """A readable binary stream for a path, raw bytes or a ``data:`` URL, and a name for messages.
    Only regular files are read (not /dev/zero, fifos or directories)."""
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
        if not data:
            raise MediaError(f"the {what} is empty (0 bytes)")
        return io.BytesIO(data), f"the {what}"
    if isinstance(source, str) and source.startswith("data:"):
        _, comma, payload = source.partition(",")
        if not comma:
            raise MediaError(f"the {what} data URL has no ',' before its payload")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError(f"the {what} data URL is not valid base64") from None
        return _open_source(data, what)
    if not isinstance(source, str | os.PathLike):
        raise MediaError(f"the {what} must be a path, bytes or a data URL, got {type(source).__name__}")
    path = Path(source)
    if not path.is_file():
        raise MediaError(f"{what} file {path} does not exist or is not a regular file")
    if path.stat().st_size == 0:
        raise MediaError(f"{what} file {path.name} is empty (0 bytes)")
    try:
        return open(path, "rb"), path.name  # closed by the caller's `with`
    except OSError as e:
        raise MediaError(f"{what} file {path.name} cannot be opened: {e.strerror}") from None


def load_image(source: str | os.PathLike | bytes, max_pixels: int = 50_000_000):
    """An image file (path, bytes or data URL) -> an RGB ``PIL.Image.Image``.

    Refused before decoding: not an image, a format outside IMAGE_FORMATS, empty, zero-sized,
    more than ``max_pixels`` pixels (also Pillow's own decompression-bomb limit)."""
    from PIL import Image, ImageOps

    if max_pixels < 1:
        raise ValueError("max_pixels must be >= 1")
    f, name = _open_source(source, "image")
    with f, warnings.catch_warnings():
        # our own cap is checked below; Pillow's warning level (89 MP) must not turn into noise
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(f, formats=IMAGE_FORMATS)  # lazy: reads the header only
        except Image.DecompressionBombError as e:
            raise MediaError(f"{name} is a decompression bomb: {e}") from None
        except Image.UnidentifiedImageError:
            raise MediaError(f"{name} is not an image in a supported format "
                             f"({', '.join(IMAGE_FORMATS)})") from None
        except Exception as e:  # a malformed header: any parser error is the file's fault
            raise MediaError(f"{name} has a malformed image header: {_short(e)}") from None
        w, h = img.size
        if w < 1 or h < 1:
            raise MediaError(f"{name} declares an empty image ({w}x{h})")
        if w * h > max_pixels:
            raise MediaError(f"{name} is {w}x{h} = {w * h:,} pixels, over the cap of "
                             f"{max_pixels:,}; downscale it first")
        try:
            img.load()  # the only place pixels are decoded
            img = ImageOps.exif_transpose(img)  # as transformers.image_utils.load_image does
        except Exception as e:  # truncated data, bad tiles, broken EXIF, ...
            raise MediaError(f"{name} cannot be decoded ({img.format}): {_short(e)}") from None
    return _convert_rgb(img)


def _convert_rgb(img):
    """``transformers.image_transforms.convert_to_rgb`` for PIL images: any alpha band or palette /
    single-colour transparency is composited onto white, everything else is ``convert("RGB")``."""
    from PIL import Image

    if img.mode == "RGB":
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def load_audio(source: str | os.PathLike | bytes, sampling_rate: int, max_seconds: float) -> np.ndarray:
    """An audio file (path, bytes or data URL) -> float32 mono samples at ``sampling_rate``, the
    waveform HF's own loader gives for the same file (``mono_resampled``).

    Refused before reading frames: not audio (or a format outside AUDIO_FORMATS), empty, longer
    than ``max_seconds``, an absurd sample rate or channel count; non-finite samples after."""
    import soundfile as sf

    if sampling_rate < 1 or not max_seconds > 0:
        raise ValueError("sampling_rate must be >= 1 and max_seconds > 0")
    f, name = _open_source(source, "audio")
    with f:
        try:
            snd = sf.SoundFile(f)  # parses the header only
        except Exception as e:  # LibsndfileError (a RuntimeError) and friends
            raise MediaError(f"{name} is not an audio file in a supported format "
                             f"({', '.join(AUDIO_FORMATS)}): {_short(e)}") from None
        with snd:
            fmt, rate, channels, frames = snd.format, snd.samplerate, snd.channels, snd.frames
            if fmt not in AUDIO_FORMATS:
                raise MediaError(f"{name} is {fmt} audio; supported: {', '.join(AUDIO_FORMATS)}")
            if not AUDIO_RATES[0] <= rate <= AUDIO_RATES[1]:
                raise MediaError(f"{name} declares a sample rate of {rate} Hz (supported "
                                 f"{AUDIO_RATES[0]}-{AUDIO_RATES[1]} Hz)")
            if not 1 <= channels <= MAX_AUDIO_CHANNELS:
                raise MediaError(f"{name} declares {channels} channels (at most {MAX_AUDIO_CHANNELS})")
            if frames <= 0:
                raise MediaError(f"{name} holds no audio (0 frames)")
            seconds = frames / rate
            if seconds > max_seconds:
                raise MediaError(f"{name} is {seconds:.2f} s long, longer than the {max_seconds:g} s "
                                 "this model takes; trim it")
            # never read more than max_seconds, whatever the header claimed
            limit = min(frames, math.floor(max_seconds * rate) + 1)
            try:
                data = snd.read(frames=limit, dtype="float32", always_2d=True)
            except Exception as e:
                raise MediaError(f"{name} cannot be decoded ({fmt}): {_short(e)}") from None
    if data.shape[0] == 0:
        raise MediaError(f"{name} holds no audio (0 frames could be decoded)")
    if data.shape[0] > max_seconds * rate:  # a header that under-stated its length
        raise MediaError(f"{name} is longer than the {max_seconds:g} s this model takes; trim it")
    if not np.isfinite(data).all():
        raise MediaError(f"{name} holds NaN or infinite samples")
    with np.errstate(over="ignore", invalid="ignore"):  # refused just below, not warned about
        mono = mono_resampled(data, rate, sampling_rate)
    if not np.isfinite(mono).all():  # float samples near float32's max overflow the channel mean
        raise MediaError(f"{name} holds samples too large to mix or resample (beyond float32)")
    return mono


def mono_resampled(frames: np.ndarray, rate: int, sampling_rate: int) -> np.ndarray:
    """Decoded frames [N, C] f32 at ``rate`` -> mono f32 at ``sampling_rate``, with the steps and
    dtypes of ``transformers.audio_utils.load_audio`` (its soundfile backend, the same as
    ``librosa.load``): what HF processors and chat templates do with an audio path, so a file
    gives HF's waveform bit for bit. The channel mean in float32 over the [C, N] view; soxr's
    ``soxr_hq`` resampler; the result padded with zeros or cut to ``ceil(N * sampling_rate /
    rate)`` samples. Not clipped: a resampled clip near full scale overshoots 1 in HF too."""
    waveform = frames.T  # [C, N], as HF reads it
    waveform = waveform.mean(axis=0) if waveform.shape[0] > 1 else waveform[0]
    if rate != sampling_rate:
        import soxr

        n = math.ceil(waveform.shape[-1] * sampling_rate / rate)
        waveform = soxr.resample(waveform, rate, sampling_rate, quality="soxr_hq")
        waveform = np.pad(waveform, (0, max(0, n - len(waveform))))[:n]
    return np.ascontiguousarray(waveform, dtype=np.float32)


def _short(e: Exception) -> str:
    """One line of an exception's text (libraries put newlines and whole dumps in theirs; libsndfile
    errors carry the bare reason in ``error_string``, without the stream's repr)."""
    text = " ".join(str(getattr(e, "error_string", None) or e).split())
    return (text[:200] + "...") if len(text) > 200 else text or type(e).__name__
