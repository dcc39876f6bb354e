"""Attestation with a real engine on spawned gloo ranks: a load that one rank gets wrong is
refused on every rank, with one line, and changes no engine; a correct one attests."""

from __future__ import annotations

import attestation_workers as workers

from zeroshard.launch import spawn


def test_a_load_one_rank_gets_wrong_is_refused_on_every_rank_and_changes_nothing(tmp_path):
    results = spawn(workers.refused_on_every_rank, 2, (str(tmp_path),), timeout_s=240)
    messages = {result["message"] for result in results}
    assert len(messages) == 1
    message = messages.pop()
    assert message is not None and "\n" not in message, message
    assert "not loaded (nothing changed): attestation failed: " in message and "exp_avg on rank 1" not in message
    assert "exp_avg holds digest" in message and str(tmp_path / "ckpt") in message
    for result in results:
        assert result["kind"] == "AttestationError" and result["unchanged"]
        assert result["exact"] and result["line"].startswith("attested: ") and "match the digests saved in" in result["line"]
