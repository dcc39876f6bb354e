"""Exports out of any checkpoint kind: the consolidated fp32 model (:mod:`.fp32`)."""
