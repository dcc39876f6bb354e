"""Exports out of any checkpoint kind: the consolidated fp32 model (:mod:`.fp32`).

May import: the checkpoint layer's hub and every format below it (:mod:`..universal`,
:mod:`..native`, :mod:`..attest`), ``zeroshard.io`` and ``layout``.
"""
