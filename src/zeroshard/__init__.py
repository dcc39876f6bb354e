"""zeroshard: ZeRO stage 1/2 data-parallel training with aligned flat buffers and portable checkpoints."""

__version__ = "0.1.0"
