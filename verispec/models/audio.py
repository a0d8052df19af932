"""Audio in for speech-to-text targets (Whisper): a sound file becomes the input features the model's encoder reads.

libsndfile (``soundfile``) reads the file (WAV, FLAC, OGG, ...), channels are averaged to mono, libsoxr (``soxr``)
resamples it to the feature extractor's rate, and the model's own feature extractor (``AutoFeatureExtractor``, from
the model folder) computes its log-mel features. Whisper reads 30 s at a time; a longer file is refused rather than
cut (nothing lost silently): long-form, chunked transcription is not built. Both libraries are the ``audio`` extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..acquire import Progress, ZooError, resolve, say

NO_AUDIO_LIBRARIES = "reading audio needs soundfile and soxr: pip install 'verispec[audio]'"


def read_audio(path: str | Path, sampling_rate: int) -> Any:
    """The sound in ``path`` as mono float32 samples at ``sampling_rate`` (a numpy array). ``ValueError`` for a file
    that is missing, unreadable or silent (no samples)."""
    try:
        import soundfile
        import soxr
    except ImportError as error:
        raise ValueError(NO_AUDIO_LIBRARIES) from error
    try:
        samples, rate = soundfile.read(str(path), dtype="float32", always_2d=True)  # [frames, channels]
    except (OSError, RuntimeError) as error:  # soundfile.LibsndfileError is a RuntimeError
        raise ValueError(f"cannot read audio file {str(path)!r}: {error}") from error
    if samples.shape[0] == 0:
        raise ValueError(f"audio file {str(path)!r} holds no samples")
    mono = samples.mean(axis=1)
    return mono if rate == sampling_rate else soxr.resample(mono, rate, sampling_rate).astype("float32")


def load_feature_extractor(name_or_path: str, progress: Progress | None = None) -> Any:
    """The feature extractor saved with a speech model (its folder's ``preprocessor_config.json``)."""
    from transformers import AutoFeatureExtractor

    try:
        files = resolve(name_or_path, backend="torch", progress=progress)
        say(progress, f"loading feature extractor from {files.path}")
        return AutoFeatureExtractor.from_pretrained(str(files.path), local_files_only=True)
    except (ZooError, OSError, ValueError) as error:
        raise ValueError(f"no feature extractor for {name_or_path!r} (a speech model's folder has a "
                         f"preprocessor_config.json): {error}") from error


def audio_features(path: str | Path, feature_extractor: Any) -> torch.Tensor:
    """``[mel bins, frames]``: the input features of the sound in ``path``, as ``feature_extractor`` computes them
    for one input. ``ValueError`` for a sound longer than the model reads at once."""
    rate = feature_extractor.sampling_rate
    samples = read_audio(path, rate)
    longest = getattr(feature_extractor, "n_samples", None)  # Whisper: 30 s
    if longest is not None and len(samples) > longest:
        raise ValueError(f"audio file {str(path)!r} lasts {len(samples) / rate:.1f} s; the model reads at most "
                         f"{longest / rate:.0f} s at once (long-form transcription is not supported: cut the file)")
    features = feature_extractor(samples, sampling_rate=rate, return_tensors="pt")["input_features"]
    return features[0]  # [mel bins, frames]


__all__ = ["audio_features", "load_feature_extractor", "read_audio"]
