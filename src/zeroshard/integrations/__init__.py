"""zeroshard inside the trainers people already run: transformers' Trainer, Accelerate, Lightning.

This package owns the glue between the engine and those frameworks, one module per framework:

* :mod:`.transformers`: ``ZeroShardTrainer``, a ``transformers.Trainer`` whose optimizer is a
  ZeroOptimizer and whose ``checkpoint-N/`` folders hold a zeroshard sharded checkpoint;
* :mod:`.accelerate`: ``prepare_zeroshard(accelerator, model, optimizer)``, beside
  ``accelerator.prepare``, with ``save_state`` / ``load_state`` writing and reading every rank's shard;
* :mod:`.lightning`: ``ZeroShardStrategy``, registered as ``Trainer(strategy="zeroshard")``;

and what they share, which imports no framework: :mod:`.building` (an engine from a
framework's settings, the checks every framework makes) and :mod:`.saves` (sharded saves
into a framework's checkpoint folder, resume checks, an fp32 model export).

May import: everything below it (the engine, the checkpoint layer, ``zeroshard.deepspeed``'s
config mapping, the MoE package, ``zeroshard.io``); only the demos and the CLI sit above it,
and neither imports it. Nothing here runs on ``import zeroshard``, so the frameworks stay
optional extras (``zeroshard[transformers]``, ``zeroshard[accelerate]``,
``zeroshard[lightning]``). docs/INTEGRATIONS.md is the user's guide.
"""
