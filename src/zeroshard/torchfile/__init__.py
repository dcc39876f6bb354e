"""A reader of ``torch.save`` files that needs no torch and trusts nothing in them.

Owns the zip directory of the archive (:mod:`.zip_directory`), the checks of a pickle's
opcodes (:mod:`.pickle_scan`) and of what hashing its dict keys and set elements costs
(:mod:`.pickle_keys`, :mod:`.pickle_hashing`), the restricted unpickler
(:mod:`.torch_unpickler`), the records of storages and tensor views it yields
(:mod:`.torch_records`; :mod:`.record_cache` keeps whole records for readers of several
ranges of them), and :func:`~.torch_file.load_torch_file`, which puts them together
within a byte budget. It knows nothing of DeepSpeed: a caller allows the globals its files
need (``zeroshard.deepspeed.checkpoint`` allows DeepSpeed's).

May import: ``zeroshard.io`` (the byte budget, ``open_member``, the dtype table, the range
mapping of files) and nothing else of zeroshard, so it can be used alone.
"""
