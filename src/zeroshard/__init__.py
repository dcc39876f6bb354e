"""zeroshard: ZeRO stage 1/2 data-parallel training with aligned flat buffers and portable checkpoints.

The package face: owns ``__version__``, ``CHECKPOINT_FORMATS`` (the checkpoint readers, by
name) and ``from_deepspeed_config`` / ``DeepSpeedRun``, imported on first use. docs/DESIGN.md
has the map of the packages below it.

May import: ``zeroshard.lazy_exports`` only; everything else it names by string, so the
layers that read ``__version__`` or the formats table may import it.
"""

__version__ = "0.1.0"

# The checkpoint formats zeroshard reads, as "module:attribute" of a
# zeroshard.checkpoint.formats.SourceFormat, in the order they are tried on a path. Declared
# here, above every layer, like packaging entry points: the checkpoint layer loads them by
# name when a checkpoint is first opened, so it never imports the readers built on it.
CHECKPOINT_FORMATS = (
    "zeroshard.checkpoint.universal.source:UNIVERSAL_FORMAT",
    "zeroshard.deepspeed.checkpoint:DEEPSPEED_FORMAT",
    "zeroshard.checkpoint.native.source:NATIVE_FORMAT",
)

from .lazy_exports import lazy_exports  # noqa: E402

# Imported on first use: `import zeroshard` (the CLI's checkpoint commands) stays torch-free.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "from_deepspeed_config": ".deepspeed.config",
        "DeepSpeedRun": ".deepspeed.config",
    },
)
