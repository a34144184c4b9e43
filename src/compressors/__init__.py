"""The gradient compressors and their family: payload format, checks, top-k selection, quantization
codes, error feedback, compression policy. ``src/compression.py`` is their face; this one imports the
registry, so that every payload kind is known wherever a module of the folder is imported.
"""

from src.compressors.registry import COMPRESSORS, build_compressor

__all__ = ["COMPRESSORS", "build_compressor"]
