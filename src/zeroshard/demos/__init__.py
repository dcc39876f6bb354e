"""The demos ``zeroshard demo`` runs, and the data they train on: not part of the library's API.

Owns the dense arc (:mod:`.dense`: TinyGPT trained with ZeRO, saved, resumed at another world
size), the MoE arc (:mod:`.moe`: MoEGPT, or the transformers Qwen3-MoE of :mod:`.hf`, at
(W, EP) and resumed at another), the synthetic token stream they learn (:mod:`.data`), and
the report lines both print (:mod:`.report`).

May import: everything below the CLI (the engine, moe, the checkpoint layer, ``launch``, the
small models of ``zeroshard.models``); only ``zeroshard.cli`` imports it.
"""
