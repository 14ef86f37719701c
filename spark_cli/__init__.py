"""Spark: run MoE GGUF models larger than VRAM through an exact expert cache."""

__version__ = "0.1.0"
